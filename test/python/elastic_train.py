"""Run by test_elastic.py under horovodrun's elastic mode: trains a small model with
hvd.DistributedOptimizer under hvd.elastic.run, committing after every step. Step t uses
global batch t, split evenly over the ranks of the moment, so the result does not depend
on how many ranks took each step. Variables:
  ELASTIC_STEPS      steps to train;
  ELASTIC_KILL_HOST  the worker of this host (HOROVOD_HOSTNAME) SIGKILLs itself in the
                     middle of step ELASTIC_KILL_AT (after backward, before step());
  ELASTIC_KILL_RANK  under torchrun: the worker of this RANK does, once (it leaves the
                     file ELASTIC_KILL_MARK behind, and a restarted worker sees it);
  ELASTIC_COMMIT_DIR TorchState(..., commit_dir=): commits to disk;
  ELASTIC_ADD_HOST   a line rank 0 appends to ELASTIC_HOSTS_FILE (the discovery
                     script's output) after step ELASTIC_ADD_AT;
  ELASTIC_DROP_HOST  a line rank 0 removes from it then instead;
  ELASTIC_OUT        a folder: rank 0 writes the final weights there (final.pt) and every
                     rank logs the size each step ran at (sizes.<pid>);
  ELASTIC_ZERO       "" (hvd.DistributedOptimizer over SGD with momentum), or a
                     DistributedZeroOptimizer over AdamW: "1", "2", "3" (the stage), with
                     "-offload" (offload_optimizer="cpu"), "-nvme" (offload_optimizer="nvme", its
                     files under ELASTIC_OUT) or "-hybrid" (shard_group="node")."""

import os
import signal
import time

import torch
import torch.nn.functional as F

import horovod_zero.torch as hvd

BATCH = 12  # every size the tests reach (1 to 4) divides it


def global_batch(t):
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 3, generator=g)


def make_model():
    torch.manual_seed(0)  # every rank alike; a joining worker gets rank 0's values anyway
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def make_optimizer(model, zero=""):
    if zero:
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def wrap(model, zero):
    if not zero:
        return hvd.DistributedOptimizer(make_optimizer(model), named_parameters=model.named_parameters())
    stage, _, extra = zero.partition("-")
    nvme = os.path.join(os.environ["ELASTIC_OUT"], "nvme") if extra == "nvme" else None
    if nvme:
        os.makedirs(nvme, exist_ok=True)  # every worker's swap files, each in a folder of its own
    return hvd.DistributedZeroOptimizer(make_optimizer(model, zero), model=model, stage=int(stage),
                                        offload_optimizer={"offload": "cpu", "nvme": "nvme"}.get(extra),
                                        nvme_path=nvme, shard_group="node" if extra == "hybrid" else None)


def main():
    hvd.init()
    steps = int(os.environ["ELASTIC_STEPS"])
    out = os.environ["ELASTIC_OUT"]
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    mark = os.environ.get("ELASTIC_KILL_MARK", "")
    victim = host == os.environ.get("ELASTIC_KILL_HOST") or (
        "ELASTIC_KILL_RANK" in os.environ and os.environ.get("RANK") == os.environ["ELASTIC_KILL_RANK"]
        and not os.path.exists(mark))
    kill_at = int(os.environ.get("ELASTIC_KILL_AT", "-1")) if victim else -1
    zero = os.environ.get("ELASTIC_ZERO", "")
    model = make_model()
    opt = wrap(model, zero)
    state = hvd.elastic.TorchState(model, opt, commit_dir=os.environ.get("ELASTIC_COMMIT_DIR"), step=0)
    log = open(os.path.join(out, f"sizes.{os.getpid()}"), "a")

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            t = state.step
            x, y = global_batch(t)
            n = BATCH // hvd.size()
            rows = slice(hvd.rank() * n, (hvd.rank() + 1) * n)
            opt.zero_grad()
            F.mse_loss(model(x[rows]), y[rows]).backward()
            if t == kill_at:
                if mark:
                    open(mark, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others wait for its gradients
            opt.step()
            log.write(f"{t} {hvd.size()}\n")
            log.flush()
            state.step += 1
            if hvd.rank() == 0 and t == int(os.environ.get("ELASTIC_ADD_AT", "-1")):
                path = os.environ["ELASTIC_HOSTS_FILE"]
                lines = open(path).read().split()
                lines = [h for h in lines if h != os.environ.get("ELASTIC_DROP_HOST")]
                lines += [os.environ["ELASTIC_ADD_HOST"]] if "ELASTIC_ADD_HOST" in os.environ else []
                with open(path, "w") as f:
                    f.write("".join(h + "\n" for h in lines))
            time.sleep(float(os.environ.get("ELASTIC_STEP_SLEEP", "0")))  # time for the launcher to notice
            state.commit()

    train(state)
    if zero.startswith("3"):
        with opt.gathered_params():
            weights = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        weights = model.state_dict()
    if hvd.rank() == 0:
        torch.save(weights, os.path.join(out, "final.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
