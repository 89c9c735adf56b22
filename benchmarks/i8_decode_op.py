"""Time the intel target's i8 attention op on a decode step alone, in C++, as a model meets it: each layer's int8
blocks read from memory (64 MB written between rounds evicts them), beside the same blocks read alone in the same
order (the floor the memory sets) and one layer's blocks again and again (the arithmetic, its blocks cached).

    python benchmarks/i8_decode_op.py [slots=4000] [layers=12] [rounds=300] [--avx2] [--no-amx] [--prompt]

Compiles a small driver around backends/intel/kvexport_intel/native/int8_paged_attention.cpp (its decode called
directly: no OpenVINO graph, no Python per call) with the flags kvexport_intel.int8_blocks uses; --avx2 builds it as
an AVX2-only CPU would (-mno-avx512f). Shape: 12 query / 4 KV heads, head_dim 64, blocks of 32, two threads.
Prints medians and first quartiles of microseconds per layer. --prompt times a prompt of `slots` tokens instead (the
op's prompt path, its tiles on the threads; one layer's blocks a round, milliseconds); --no-amx builds the driver
without AMX (an AMX CPU's prompts then run the VNNI and AVX512-BF16 kernels)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import openvino as ov
from kvexport_intel import extension, int8_blocks

DRIVER = r'''
#include "op.cpp"
#include <chrono>
#include <cstdio>
#include <random>
#include <tbb/global_control.h>
typedef int64_t line __attribute__((vector_size(64)));  // one cache line, in whatever vectors the CPU has
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main(int argc, char** argv) {
  const int64_t P = atoi(argv[1]), LAYERS = atoi(argv[2]), ROUNDS = atoi(argv[3]);
  tbb::global_control threads(tbb::global_control::max_allowed_parallelism, 2);
  const Shape sh{12, 4, 64, 32, 3};
  const int64_t nb = (P + 1) / sh.BS + 2, bytes = nb * sh.KV * sh.row_bytes();
  std::mt19937 rng(0);
  std::vector<std::vector<int8_t>> K(LAYERS), V(LAYERS);
  for (auto* caches : {&K, &V})
    for (auto& c : *caches) {
      c.resize(bytes);
      for (auto& x : c) x = (int8_t)(rng() % 200 - 100);
      for (int64_t b = 0; b < nb * sh.KV; b++) {
        float* s = scales_of(c.data() + b * sh.row_bytes(), sh);
        for (int64_t j = 0; j < sh.BS; j++) s[j] = 0.01f;
      }
    }
  std::vector<int32_t> past{(int32_t)P}, begins{0, 1}, blocks(nb), bounds{0, (int32_t)nb};
  for (int64_t b = 0; b < nb; b++) blocks[b] = (int32_t)b;
  const Seqs seqs{past.data(), begins.data(), blocks.data(), bounds.data(), 1};
  if (argc > 4) {  // a prompt of P tokens (held 0) over the blocks, each round: its attention, the blocks as written
    std::vector<int32_t> none{0}, all{0, (int32_t)P};
    const Seqs prompt{none.data(), all.data(), blocks.data(), bounds.data(), 1};
    std::vector<float> q(P * sh.H * sh.D), out(P * sh.H * sh.D);
    std::normal_distribution<float> normal;
    for (auto& x : q) x = normal(rng);
    std::vector<double> took;
    for (int64_t r = 0; r < ROUNDS; r++) {
      double t = now();
      Int8PagedAttention::prompt(q.data(), out.data(), K[r % LAYERS].data(), V[r % LAYERS].data(), sh, prompt,
                                 0.125f, 0);
      took.push_back(now() - t);
    }
    std::sort(took.begin(), took.end());
    printf("prompt of %ld tokens, a layer (%s): %.2f ms (p25 %.2f)  [%g]\n", (long)P, kvexport_i8_kernels(sh.D),
           took[took.size() / 2] * 1e3, took[took.size() / 4] * 1e3, out[7]);
    return 0;
  }
  std::vector<float> q(sh.H * sh.D), out(sh.H * sh.D), evict(16 << 20, 1.f);
  std::normal_distribution<float> normal;
  for (auto& x : q) x = normal(rng);
  std::vector<double> cold, hot, read;
  double check = 0;
  for (int64_t r = 0; r < ROUNDS; r++) {
    for (auto& x : evict) x += 1.f;
    double t = now();
    for (int64_t l = 0; l < LAYERS; l++)
      Int8PagedAttention::decode(q.data(), out.data(), K[l].data(), V[l].data(), sh, seqs, 0.125f, 0);
    cold.push_back((now() - t) / LAYERS);
    t = now();
    for (int64_t l = 0; l < LAYERS; l++)
      Int8PagedAttention::decode(q.data(), out.data(), K[0].data(), V[0].data(), sh, seqs, 0.125f, 0);
    hot.push_back((now() - t) / LAYERS);
    check += out[5];
    for (auto& x : evict) x += 1.f;
    t = now();
    for (int64_t l = 0; l < LAYERS; l++) {  // the blocks alone, the runs of each head as the op splits them
      const int64_t runs = (P + RUN) / RUN;
      std::vector<int64_t> sums(runs * sh.KV);
      tbb::parallel_for(int64_t(0), runs * sh.KV, [&](int64_t i) {
        const int64_t h = i / runs, run = i % runs;
        line sum = {};
        for (int64_t slot = run * RUN; slot < std::min(P + 1, (run + 1) * RUN); slot += sh.BS)
          for (int64_t at = 0; at < sh.row_bytes(); at += 64) {
            line k, v;
            std::memcpy(&k, rows_of(K[l].data(), sh, slot / sh.BS, h) + at, 64);
            std::memcpy(&v, rows_of(V[l].data(), sh, slot / sh.BS, h) + at, 64);
            sum += k + v;
          }
        sums[i] = sum[0] + sum[7];
      });
      for (auto x : sums) check += x * 1e-9;
    }
    read.push_back((now() - t) / LAYERS);
  }
  for (auto* v : {&cold, &hot, &read}) std::sort(v->begin(), v->end());
  auto us = [&](const std::vector<double>& v) { return std::make_pair(v[v.size() / 2] * 1e6, v[v.size() / 4] * 1e6); };
  printf("decode over %ld slots, a layer: from memory %.1f us (p25 %.1f); cached %.1f us (p25 %.1f); "
         "the blocks read alone %.1f us (p25 %.1f)  [%g]\n", (long)P, us(cold).first, us(cold).second,
         us(hot).first, us(hot).second, us(read).first, us(read).second, check);
}
'''


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("slots", type=int, nargs="?", default=4000, help="slots a sequence holds (default 4000)")
    ap.add_argument("layers", type=int, nargs="?", default=12, help="layers' blocks read in turn (default 12)")
    ap.add_argument("rounds", type=int, nargs="?", default=300, help="timed rounds (default 300)")
    ap.add_argument("--avx2", action="store_true", help="build the driver as an AVX2-only CPU would (-mno-avx512f)")
    ap.add_argument("--no-amx", action="store_true", help="build the driver without AMX (-mno-amx-tile)")
    ap.add_argument("--prompt", action="store_true", help="time a prompt of `slots` tokens instead (one layer a round)")
    a = ap.parse_args(argv)
    avx2, slots, layers, rounds = a.avx2, a.slots, a.layers, a.rounds
    include, libs = Path(ov.__file__).parent / "include", Path(ov.__file__).parent / "libs"
    with tempfile.TemporaryDirectory() as tmp:
        # the op's class with its decode callable from the driver
        (Path(tmp) / "op.cpp").write_text(int8_blocks.SOURCE.read_text().replace("\n private:", "\n public:"))
        (Path(tmp) / "driver.cpp").write_text(DRIVER)
        flags = [f for f in extension.FLAGS if f not in ("-shared", "-fPIC")] + ["-w"] + (["-mno-avx512f"] if avx2 else []) \
            + (list(int8_blocks.VARIANTS["KVEXPORT_I8_NO_AMX"]) if a.no_amx else [])
        exe = Path(tmp) / "driver"
        cxx = os.environ.get("CXX") or "c++"  # the compiler int8_blocks.library() takes
        subprocess.run([cxx, *flags, str(Path(tmp) / "driver.cpp"), f"-I{include}", f"-I{extension.SHARED}",
                        str(sorted(libs.glob("libopenvino.so*"))[0]), str(sorted(libs.glob("libtbb.so*"))[0]),
                        f"-Wl,-rpath,{libs}", "-o", str(exe)], check=True)
        mode = ["prompt"] if a.prompt else []
        subprocess.run([str(exe), str(slots), str(layers), str(rounds), *mode], check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
