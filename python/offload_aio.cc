// horovod_zero._core.AioFile: csrc/offload/aio_file.h on CPU tensors, for the NVMe
// swapper (horovod_zero/torch/zero/offload/nvme.py). What the disk or the kernel
// refuses becomes OSError; bad arguments and a closed file, ValueError.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <unordered_map>

#include "offload/aio_file.h"
#include "offload_aio.h"

namespace py = pybind11;

namespace hvdz {
namespace {

void Check(const Status& s) {
  if (s.ok()) return;
  if (s.type() == StatusType::kInvalidArgument || s.type() == StatusType::kPreconditionError)
    throw py::value_error(s.reason());
  PyErr_SetString(PyExc_OSError, s.reason().c_str());
  throw py::error_already_set();
}

class PyAioFile {
 public:
  PyAioFile(const std::string& path, int64_t nbytes, int queue_depth, int64_t request_bytes, double timeout_seconds)
      : timeout_(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(timeout_seconds))) {
    if (!(timeout_seconds > 0)) throw py::value_error("AioFile timeout_seconds must be > 0.");
    AioOptions o;
    o.queue_depth = queue_depth;
    o.request_bytes = request_bytes;
    Status s;
    {
      py::gil_scoped_release nogil;  // fallocate of a large file takes a while
      s = AioFile::Open(path, nbytes, o, &file_);
    }
    Check(s);
  }

  // The kernel may still be using kept_'s buffers: close (wait) before they go.
  // The GIL stays held: the reaper does not need it, and this may run at exit.
  ~PyAioFile() { file_->Close(); }

  int64_t ReadAsync(const at::Tensor& t, int64_t offset) { return Start(t, offset, /*write=*/false); }
  int64_t WriteAsync(const at::Tensor& t, int64_t offset) { return Start(t, offset, /*write=*/true); }

  // In slices, for the reason in adapter.cc's [Note: interruptible waits]; a
  // transfer interrupted by Ctrl-C goes on, and its ticket stays valid.
  void Wait(int64_t ticket) {
    const auto give_up = std::chrono::steady_clock::now() + timeout_;
    while (true) {
      bool done = false;
      Status s;
      {
        py::gil_scoped_release nogil;
        const auto slice = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
        s = file_->WaitUntil(ticket, std::min(slice, give_up), &done);
      }
      if (done || !s.ok()) {
        kept_.erase(ticket);
        return Check(s);
      }
      if (std::chrono::steady_clock::now() >= give_up)
        Check(Status::Error("No answer from the disk for '" + file_->path() + "' in " +
                            std::to_string(std::chrono::duration<double>(timeout_).count()) + " s (ticket " +
                            std::to_string(ticket) + " still in flight)."));
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  void Close() {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = file_->Close();
    }
    kept_.clear();  // the kernel is done with every buffer
    Check(s);
  }

  const AioFile& file() const { return *file_; }

 private:
  int64_t Start(const at::Tensor& t, int64_t offset, bool write) {
    const char* what = write ? "write_async" : "read_async";
    if (!t.defined()) throw py::value_error(std::string(what) + ": the tensor is None.");
    if (!t.is_cpu())
      throw py::value_error(std::string(what) + ": the tensor is on " + t.device().str() +
                            "; direct I/O needs a CPU tensor.");
    if (!t.is_contiguous()) throw py::value_error(std::string(what) + ": the tensor is not contiguous.");
    int64_t ticket = 0;
    void* p = t.numel() ? t.data_ptr() : nullptr;
    const int64_t n = static_cast<int64_t>(t.nbytes());
    Check(write ? file_->Write(p, n, offset, &ticket) : file_->Read(p, n, offset, &ticket));
    kept_.emplace(ticket, t);
    return ticket;
  }

  std::chrono::steady_clock::duration timeout_;
  std::unique_ptr<AioFile> file_;
  std::unordered_map<int64_t, at::Tensor> kept_;  // buffers the kernel may still use, by ticket
};

}  // namespace

void RegisterOffloadAio(py::module_& m) {
  m.attr("HAVE_LIBURING") = true;
  py::class_<PyAioFile>(m, "AioFile",
                        "A file read and written with O_DIRECT through io_uring. Tensors must be CPU, contiguous, "
                        "and their address, length and the file offset multiples of `alignment`.")
      .def(py::init<const std::string&, int64_t, int, int64_t, double>(), py::arg("path"), py::arg("nbytes"),
           py::arg("queue_depth") = 8, py::arg("request_bytes") = 1 << 20, py::arg("timeout_seconds") = 600.0)
      .def("read_async", &PyAioFile::ReadAsync, py::arg("tensor"), py::arg("offset"))
      .def("write_async", &PyAioFile::WriteAsync, py::arg("tensor"), py::arg("offset"))
      .def("wait", &PyAioFile::Wait, py::arg("ticket"))
      .def("close", &PyAioFile::Close)
      .def_property_readonly("path", [](const PyAioFile& f) { return f.file().path(); })
      .def_property_readonly("size", [](const PyAioFile& f) { return f.file().size(); })
      .def_property_readonly("alignment", [](const PyAioFile& f) { return f.file().alignment(); })
      .def_property_readonly("queue_depth", [](const PyAioFile& f) { return f.file().queue_depth(); })
      .def_property_readonly("request_bytes", [](const PyAioFile& f) { return f.file().request_bytes(); })
      .def_property_readonly("bytes_read", [](const PyAioFile& f) { return f.file().bytes_read(); })
      .def_property_readonly("bytes_written", [](const PyAioFile& f) { return f.file().bytes_written(); })
      .def_property_readonly("transfers_in_flight", [](const PyAioFile& f) { return f.file().transfers_in_flight(); });
}

}  // namespace hvdz
