"""`import horovod.torch as hvd` is horovod_zero's API where Horovod's own cannot run
(horovod_zero/horovod_compat.py): a script written for Horovod runs unchanged under
horovodrun and trains as Horovod documents DistributedOptimizer (gradients averaged over
ranks), while Horovod's launcher modules, which our horovodrun runs, stay Horovod's."""

import importlib.machinery
import os
import subprocess
import sys

import torch

from horovod_zero import horovod_compat
from launchers import HOROVODRUN, ROOT, SCRIPTS, clean_env, run


def _reference_weights():
    """Horovod's DistributedOptimizer averages gradients: the same steps as one process whose
    batch holds every rank's samples (horovod_script.py, 2 ranks)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * 2)
    for step in range(2):
        opt.zero_grad()
        x = torch.cat([torch.full((8, 4), float(rank + step)) for rank in range(2)])
        model(x).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_horovod_script_runs_unchanged_under_horovodrun():
    code, out, err = run([HOROVODRUN, "-np", "2", "python", os.path.join(SCRIPTS, "horovod_script.py")])
    assert code == 0, f"{out}\n{err}\n(in an environment examples/setup.sh did not make, run: "\
                      f"python -m horovod_zero.horovod_compat install)"
    rows = [dict(kv.split("=", 1) for kv in line.split("HOROVOD_SCRIPT ", 1)[1].split())
            for line in out.splitlines() if "HOROVOD_SCRIPT " in line]
    assert len(rows) == 2
    for r in rows:
        assert r["module"] == "horovod_zero.torch" and float(r["total"]) == 3.0
        weights = torch.tensor([float(v) for v in r["weights"].split(",")])
        torch.testing.assert_close(weights, _reference_weights())
    assert "has not been built" not in out + err  # Horovod's own horovod.torch never ran


def _fake_horovod(root, built):
    """A horovod package with a horovod.torch of its own, with or without its extension."""
    (root / "horovod" / "torch").mkdir(parents=True)
    (root / "horovod" / "__init__.py").write_text("")
    (root / "horovod" / "torch" / "__init__.py").write_text("OWN = 'horovod'\n")
    if built:
        (root / "horovod" / "torch" / ("mpi_lib_v2" + importlib.machinery.EXTENSION_SUFFIXES[0])).write_text("")


def _python(code, *paths, site_dir=None):
    """`code` in a fresh interpreter that runs no .pth file of site-packages (-S; this
    process's sys.path instead), so that only `site_dir`'s can install the hook; `paths` come
    first on sys.path."""
    prelude = f"import sys; sys.path[:0] = {[str(p) for p in paths] + [ROOT]!r}; sys.path += {sys.path!r}; import site; "
    if site_dir:
        prelude += f"site.addsitedir({str(site_dir)!r}); "
    p = subprocess.run([sys.executable, "-S", "-c", prelude + code], env=clean_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_the_pth_line_makes_horovod_torch_ours(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / horovod_compat.PTH_NAME).write_text(horovod_compat.PTH_LINE)
    _fake_horovod(tmp_path / "unbuilt", built=False)
    out = _python(
        "import horovod.torch as hvd, horovod_zero.torch, horovod.torch.elastic as e\n"
        "from horovod.torch.mpi_ops import Sum\n"
        "assert hvd is horovod_zero.torch and e is horovod_zero.torch.elastic and Sum == hvd.Sum\n"
        "try:\n    import horovod.torch.mpi_lib_v2\nexcept ModuleNotFoundError as err:\n    print(err)",
        tmp_path / "unbuilt", site_dir=site)
    assert "No module named 'horovod.torch.mpi_lib_v2': in this environment horovod.torch is horovod_zero" in out


def test_horovod_torch_with_its_extension_built_stays_horovods(tmp_path):
    _fake_horovod(tmp_path, built=True)
    out = _python("import horovod_zero.horovod_compat as c; c.install(); import horovod.torch as t; print(t.OWN)",
                  tmp_path)
    assert out == "horovod"
