"""The CPU allocator's peak over a region, counted on every thread.

torch.profiler's memory events come only from the threads it profiles: a tensor made on the main thread and
freed on another (a collective's buffer, released by gloo's worker when its work ends) is never subtracted
from the profiler's running total, so a peak read from those events is too high by a timing-dependent amount.
This module replaces c10's CPU allocator in the process with one that forwards to it and counts the bytes
alive under one lock, whichever thread allocates or frees. Tensors made before `install()` are not counted
(their deleter is the old one), so read peaks as increments over a region: `reset()` then `peak()`.

    import cpu_peak
    cpu_peak.build()            # once, in the parent: compiles it (a few seconds, the first time)
    cpu_peak.install()          # in each process, before it makes the tensors to be counted
    cpu_peak.reset(); ...; cpu_peak.peak()   # the most bytes alive above those alive at reset()
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from functools import lru_cache

_SOURCE = r"""
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <mutex>
#include <unordered_map>

namespace {
std::mutex mu;
std::unordered_map<void*, size_t> sizes;
int64_t alive = 0, high = 0;
c10::Allocator* inner = nullptr;
c10::DeleterFnPtr inner_delete = nullptr;

void counted_delete(void* p) {
  {
    std::lock_guard<std::mutex> g(mu);
    auto it = sizes.find(p);
    if (it != sizes.end()) { alive -= (int64_t)it->second; sizes.erase(it); }
  }
  inner_delete(p);
}

struct Counting final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner->allocate(n);
    if (n == 0 || d.get() == nullptr) return d;
    // the default allocator's data and context are one pointer, freed by its raw deleter
    TORCH_CHECK(d.get() == d.get_context() && d.get_deleter() == inner_delete, "cpu_peak: unexpected DataPtr");
    void* p = d.release_context();
    {
      std::lock_guard<std::mutex> g(mu);
      sizes[p] = n;
      alive += (int64_t)n;
      if (alive > high) high = alive;
    }
    return c10::DataPtr(p, p, &counted_delete, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
Counting counting;
}

extern "C" {
void install() {
  if (inner) return;
  inner = c10::GetCPUAllocator();
  inner_delete = inner->raw_deleter();
  TORCH_CHECK(inner_delete, "cpu_peak: the CPU allocator has no raw deleter");
  c10::SetCPUAllocator(&counting, /*priority=*/255);
}
void reset() { std::lock_guard<std::mutex> g(mu); high = alive; }
int64_t current() { std::lock_guard<std::mutex> g(mu); return alive; }
int64_t high_water() { std::lock_guard<std::mutex> g(mu); return high; }
}
"""

_base = [0]


@lru_cache(maxsize=None)
def build() -> ctypes.CDLL:
    """Compile (once per source text, a few seconds: c10's headers only) and load the counting allocator."""
    import torch
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    cache = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions")),
                         "gradsched_cpu_peak")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"cpu_peak_{hashlib.sha1((_SOURCE + torch.__version__).encode()).hexdigest()[:12]}.so")
    if not os.path.exists(so):
        src = so[:-3] + ".cpp"
        with open(src, "w") as f:
            f.write(_SOURCE)
        tmp = f"{so}.{os.getpid()}"  # ranks building at once each write their own, then one rename wins
        include = os.path.join(os.path.dirname(torch.__file__), "include")
        subprocess.run(["c++", "-O2", "-std=c++17", "-shared", "-fPIC",
                        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", f"-I{include}",
                        src, f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o", tmp], check=True)
        os.replace(tmp, so)
    ext = ctypes.CDLL(so)
    ext.current.restype = ext.high_water.restype = ctypes.c_int64
    return ext


def install() -> None:
    build().install()


def reset() -> None:
    """Start a region: its peak is counted from the bytes alive now."""
    ext = build()
    ext.reset()
    _base[0] = ext.current()


def peak() -> int:
    """The most bytes alive since `reset()`, above those alive at it, on every thread."""
    return build().high_water() - _base[0]


def alive() -> int:
    """The bytes alive now above those alive at `reset()`, on every thread."""
    return build().current() - _base[0]
