#!/usr/bin/env python3
"""A model of time to first token with and without the store at GPU scale, from measured store
bandwidth and published model configurations and GPU figures (docs/performance-model.md says
which is which, with sources).

For a prompt of L tokens whose prefix is in Redis, a deployment of G GPUs either recomputes it:

    recompute(L) = (2 N L + 2 layers * heads * qk_v_dim * L^2 / 2) / (G * peak * MFU)

(N active parameters: 2 FLOPs each per token; attention: QK^T and AV over the causal half of
the L x L scores) or loads it: every rank reads its share of the KV bytes at the store
bandwidth B it gets per GPU, in parallel,

    load(L) = overhead + L * kv_bytes_per_rank / B

and loading wins above the prompt length where the two meet (never, if a token's KV takes
longer to read than to compute at every length the model takes). The bandwidth a deployment
needs is the rate at which it would compute the same tokens: ``kv bytes per token x prefill
tokens/s`` per GPU, and over the whole deployment for Redis shards.

Each way the connector can serve a hit (``connector.load_policy``) is then predicted with the
policy's own model: ``async`` loads it all first (``load(L)``), ``split`` loads its first part
layer band by layer band while the forward pass computes the rest (the two overlap), and
``auto`` takes the fastest of those and ``recompute``.

    python -m scripts.perf_model [--mfu 0.5] [--markdown] [--plot docs/plots/perf_model.png]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from connector.figures import ComputeFit, LoadFit, SplitFit
from connector.load_policy import Engine, Figures, Hit, choose
from datamover.mover import layer_bands

from .gpu_suite_summary import SUITE_FILE, best, one_server

ROOT = Path(__file__).resolve().parents[1]
# what the connector's defaults give a split: 16-token blocks, bands of at least 32 KiB
BLOCK_TOKENS = 16
SPLIT_BAND_BYTES = 32 << 10


@dataclass(frozen=True)
class Model:
    """Published configuration (the model's config.json); bytes per KV element: bf16."""

    name: str
    layers: int
    heads: int  # query heads
    qk_dim: int  # per head, as attention computes it (MLA: nope + rope)
    v_dim: int
    kv_bytes_per_token: int  # what one copy of a token's KV takes, all layers
    active_params: float
    mla: bool  # one latent every rank reads whole (not cut by TP)
    max_len: int
    source: str

    def flops(self, tokens: int) -> float:
        """Prefill FLOPs for a prompt of ``tokens``: linear layers plus causal attention."""
        linear = 2 * self.active_params * tokens
        attention = self.layers * 2 * self.heads * (self.qk_dim + self.v_dim) * tokens**2 / 2
        return linear + attention


def gqa(name: str, layers: int, heads: int, kv_heads: int, head: int, params: float,
        max_len: int, source: str) -> Model:  # fmt: skip
    return Model(name, layers, heads, head, head, 2 * layers * kv_heads * head * 2, params,
                 False, max_len, source)  # fmt: skip


MODELS = [
    gqa("Llama-3.1-8B", 32, 32, 8, 128, 8.03e9, 131072,
        "huggingface.co/meta-llama/Llama-3.1-8B config.json"),
    gqa("Qwen3-32B", 64, 64, 8, 128, 32.8e9, 32768,
        "huggingface.co/Qwen/Qwen3-32B config.json"),
    gqa("Llama-3.1-70B", 80, 64, 8, 128, 70.6e9, 131072,
        "huggingface.co/meta-llama/Llama-3.1-70B config.json"),
    # MLA: the latent (kv_lora_rank 512 + qk_rope_head_dim 64) per layer; attention as the
    # prefill computes it: 128 heads of qk 192 (128 nope + 64 rope) and v 128; 37B active
    Model("DeepSeek-V3", 61, 128, 192, 128, 61 * (512 + 64) * 2, 37e9, True, 131072,
          "huggingface.co/deepseek-ai/DeepSeek-V3 config.json; 37B activated (model card)"),
]  # fmt: skip


@dataclass(frozen=True)
class Gpu:
    name: str
    dense_tflops: float  # BF16 tensor core, dense (no sparsity)
    source: str


GPUS = [
    Gpu("H100 SXM", 989.0, "NVIDIA H100 datasheet: 989 TFLOPS BF16 dense (1,979 with sparsity)"),
    Gpu("H200 SXM", 989.0, "NVIDIA H200 datasheet: 989 TFLOPS BF16 dense, 141 GB HBM3e"),
]


@dataclass(frozen=True)
class Deployment:
    model: Model
    gpu: Gpu
    gpus: int  # one instance's GPUs (TP)
    note: str

    @property
    def kv_bytes_per_rank(self) -> float:
        """What each rank reads per token: its KV heads' slice, or the whole latent (MLA)."""
        if self.model.mla:
            return self.model.kv_bytes_per_token
        return self.model.kv_bytes_per_token / self.gpus

    def recompute_s(self, tokens: int, mfu: float) -> float:
        return self.model.flops(tokens) / (self.gpus * self.gpu.dense_tflops * 1e12 * mfu)

    def load_s(self, tokens: int, gbps_per_gpu: float, overhead_s: float) -> float:
        return overhead_s + tokens * self.kv_bytes_per_rank / (gbps_per_gpu * 1e9)

    def break_even(self, gbps_per_gpu: float, mfu: float, overhead_s: float) -> int | None:
        """The shortest prompt (tokens) from which loading is faster; None: not below the
        model's context length."""
        lo, hi = 1, self.model.max_len
        if self.load_s(hi, gbps_per_gpu, overhead_s) >= self.recompute_s(hi, mfu):
            return None
        while lo < hi:  # load - recompute falls with length (recompute grows faster)
            mid = (lo + hi) // 2
            if self.load_s(mid, gbps_per_gpu, overhead_s) < self.recompute_s(mid, mfu):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def policies(
        self, tokens: int, gbps_per_gpu: float, mfu: float, overhead_s: float
    ) -> tuple[dict[str, float], str]:
        """TTFT of a cached prefix of ``tokens`` per way (seconds), by the load policy's own
        model with this deployment's figures, and what ``auto`` picks."""
        peak = self.gpus * self.gpu.dense_tflops * 1e12 * mfu
        m = self.model
        compute = ComputeFit(
            step_s=0.0,
            token_s=2 * m.active_params / peak,
            attention_s=m.layers * 2 * m.heads * (m.qk_dim + m.v_dim) / peak,
            samples=0,
        )
        loads = LoadFit(overhead_s, gbps_per_gpu * 1e9, samples=1)
        # splits' bands as fast as whole loads: the path's target (scripts.sim_load_policy
        # models them at the measured third too)
        splits = SplitFit(0.0, 0.0, gbps_per_gpu * 1e9, samples=1)
        block = BLOCK_TOKENS * self.kv_bytes_per_rank
        bands = len(layer_bands(m.layers, int(block / m.layers), SPLIT_BAND_BYTES))
        hit = Hit(0, tokens // BLOCK_TOKENS, tokens, BLOCK_TOKENS, int(block), bands)
        # one pass however long the prompt (vLLM would chunk it: the simulator models that)
        engine = Engine(token_budget=1 << 30)
        decision = choose(hit, Figures(loads, splits, compute), engine=engine)
        times = dict(decision.predicted_s)
        times["auto"] = times[decision.way.value]
        return times, decision.way.value

    def needed_gbps_per_gpu(self, tokens: int, mfu: float, overhead_s: float) -> float:
        """Store bandwidth per GPU at which loading a prompt (its overhead included) takes as
        long as computing it; infinite where computing it takes less than the overhead."""
        spare = self.recompute_s(tokens, mfu) - overhead_s
        return tokens * self.kv_bytes_per_rank / spare / 1e9 if spare > 0 else math.inf


DEPLOYMENTS = [
    Deployment(MODELS[0], GPUS[0], 1, "TP 1"),
    Deployment(MODELS[0], GPUS[1], 1, "TP 1"),
    Deployment(MODELS[1], GPUS[0], 2, "TP 2 (65 GB of bf16 weights)"),
    Deployment(MODELS[1], GPUS[1], 1, "TP 1"),
    Deployment(MODELS[2], GPUS[0], 4, "TP 4"),
    Deployment(MODELS[2], GPUS[1], 4, "TP 4"),
    Deployment(MODELS[3], GPUS[1], 8, "TP 8 (FP8 weights; the latent stored once, bf16)"),
]


@dataclass(frozen=True)
class Measured:
    """Store bandwidth measured in this repository (files under docs/)."""

    gpu_load_gbps: float  # the data mover, Redis -> pinned staging -> H100 cache, one process
    gpu_file: str
    shard_load_gbps: float  # one Redis master, loads of 2 MiB blocks, CPU VM client (2 cores)
    shard_file: str
    # the newest GPU suite (scripts/gpu_suite.sh, gathered by gpu_suite_summary): loads into
    # GPU memory from one redis-server, and from the fastest topology it measured
    suite_device: str
    suite_one_server_gbps: float
    suite_best_gbps: float
    suite_best_run: str
    suite_file: str

    @classmethod
    def from_docs(cls, suite_file: str | None = None) -> Measured:
        gpu_file = "docs/results/gpu_suite/h100-2026-11-23b.json"
        shard_file = "docs/results/bench_shards/shards-2026-11-23.json"
        suite_file = suite_file or newest_suite()
        gpu = json.loads((ROOT / gpu_file).read_text())
        shards = json.loads((ROOT / shard_file).read_text())
        suite = json.loads((ROOT / suite_file).read_text())
        _, one = one_server(suite)
        best_run, fastest = best(suite)
        return cls(
            gpu["load_GBps"],
            gpu_file,
            shards["gbps"]["standalone"]["kvstore load"],
            shard_file,
            suite["machine"].get("device", "GPU"),
            one["load_GBps"],
            fastest["load_GBps"],
            best_run,
            suite_file,
        )


def newest_suite() -> str:
    """The newest ``docs/results/gpu_suite/<host>-<date>/suite.json`` (by the date in its
    folder's name)."""
    found = sorted(
        (m.group(1), str(p.relative_to(ROOT)))
        for p in (ROOT / "docs" / "results" / "gpu_suite").glob(f"*/{SUITE_FILE}")
        if (m := re.search(r"(\d{4}-\d{2}-\d{2})", p.parent.name))
    )
    if not found:
        raise SystemExit(
            "no GPU suite figures under docs/results/gpu_suite/: run scripts/gpu_suite.sh"
        )
    return found[-1][1]


LENGTHS = (1024, 4096, 16384, 65536)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.1f}"


def report(mfu: float, overhead_s: float, measured: Measured, fast_gbps: float) -> str:
    out = []
    b = measured.gpu_load_gbps
    out.append(f"MFU {mfu:.2f}; per-load overhead {overhead_s * 1e3:.0f} ms; store bandwidth per "
               f"GPU {b:.2f} GB/s (measured: {measured.gpu_file}) and {fast_gbps:.0f} GB/s "
               "(what a faster path would give)\n")  # fmt: skip
    out.append("| deployment | KV bytes / token (per rank) | prefill tok/s per instance "
               "(2k prompt) | break-even prompt at "
               f"{b:.2f} GB/s | at {fast_gbps:.0f} GB/s | GB/s per GPU to match recompute "
               "(2k / 16k prompt) |")  # fmt: skip
    out.append("| --- | --- | --- | --- | --- | --- |")
    for d in DEPLOYMENTS:
        tps = 2048 / d.recompute_s(2048, mfu)
        slow = d.break_even(b, mfu, overhead_s)
        fast = d.break_even(fast_gbps, mfu, overhead_s)
        out.append(
            f"| {d.model.name} on {d.gpus}x {d.gpu.name} ({d.note}) | "
            f"{d.model.kv_bytes_per_token / 1024:,.1f} KiB ({d.kv_bytes_per_rank / 1024:,.1f}) | "
            f"{tps:,.0f} | {f'{slow:,}' if slow else 'never'} | "
            f"{f'{fast:,}' if fast else 'never'} | "
            f"{d.needed_gbps_per_gpu(2048, mfu, overhead_s):.2f} / "
            f"{d.needed_gbps_per_gpu(16384, mfu, overhead_s):.2f} |"
        )
    out.append("\nTTFT of the cached prefix alone, recompute against load (ms):\n")
    head = " | ".join(f"{n // 1024}k: recompute / load {b:.2f} / {fast_gbps:.0f} GB/s"
                      for n in LENGTHS)  # fmt: skip
    out.append(f"| deployment | {head} |")
    out.append("| --- |" + " --- |" * len(LENGTHS))
    for d in DEPLOYMENTS:
        cells = []
        for n in LENGTHS:
            if n > d.model.max_len:
                cells.append("beyond context")
                continue
            cells.append(f"{ms(d.recompute_s(n, mfu))} / {ms(d.load_s(n, b, overhead_s))} / "
                         f"{ms(d.load_s(n, fast_gbps, overhead_s))}")  # fmt: skip
        out.append(f"| {d.model.name}, {d.gpus}x {d.gpu.name} | " + " | ".join(cells) + " |")
    out.append(policy_table(mfu, overhead_s, measured))
    out.append("\nRedis shards to serve an instance at its full prefill rate (2k prompts all "
               f"loaded), at {measured.shard_load_gbps:.2f} GB/s per shard (measured: "
               f"{measured.shard_file}):\n")  # fmt: skip
    out.append("| deployment | GB/s the instance loads | shards |")
    out.append("| --- | --- | --- |")
    for d in DEPLOYMENTS:
        tps = 2048 / d.recompute_s(2048, mfu)
        # every rank reads its slice (MLA: every rank the whole latent)
        total = tps * d.kv_bytes_per_rank * d.gpus / 1e9
        shards = math.ceil(total / measured.shard_load_gbps)
        out.append(f"| {d.model.name}, {d.gpus}x {d.gpu.name} | {total:.1f} | {shards} |")
    return "\n".join(out)


POLICY_LENGTHS = (4096, 16384)


def policy_table(mfu: float, overhead_s: float, measured: Measured) -> str:
    """TTFT of the cached prefix per way at the bandwidths measured on the H100 and H200 hosts
    and at 4 GB/s per GPU."""
    out = [
        "\nTTFT of the cached prefix per way the connector serves it (ms: recompute / async / "
        "split / auto, and what auto picks; the load policy's own model, idle engine; "
        f"{measured.gpu_load_gbps:.2f} GB/s measured on the H100 host ({measured.gpu_file}); "
        f"{measured.suite_one_server_gbps:.2f} GB/s from one redis-server and "
        f"{measured.suite_best_gbps:.2f} GB/s at best ({measured.suite_best_run}) on the "
        f"{measured.suite_device} host ({measured.suite_file}); 4 GB/s, the target):\n"
    ]
    speeds = (
        measured.gpu_load_gbps,
        measured.suite_one_server_gbps,
        measured.suite_best_gbps,
        4.0,
    )
    head = " | ".join(f"{n // 1024}k at {b:.2f} GB/s" for b in speeds for n in POLICY_LENGTHS)
    out.append(f"| deployment | {head} |")
    out.append("| --- |" + " --- |" * (len(speeds) * len(POLICY_LENGTHS)))
    for d in DEPLOYMENTS:
        cells = []
        for b in speeds:
            for n in POLICY_LENGTHS:
                if n > d.model.max_len:
                    cells.append("beyond context")
                    continue
                t, pick = d.policies(n, b, mfu, overhead_s)
                cells.append(" / ".join(ms(t[w]) for w in ("recompute", "async", "split", "auto"))
                             + f" ({pick})")  # fmt: skip
        out.append(f"| {d.model.name}, {d.gpus}x {d.gpu.name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(path: str, mfu: float, overhead_s: float, measured: Measured, fast: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [d for d in DEPLOYMENTS if d.gpu.name == "H100 SXM" or d.model.mla]
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.6))
    for ax, d in zip(axes, shown, strict=True):
        lengths = [2**k for k in range(8, int(math.log2(d.model.max_len)) + 1)]
        ax.loglog(lengths, [d.recompute_s(n, mfu) for n in lengths], label="recompute", lw=2)
        for gbps, style in ((measured.gpu_load_gbps, "--"), (fast, ":")):
            ax.loglog(lengths, [d.load_s(n, gbps, overhead_s) for n in lengths], style,
                      label=f"load at {gbps:.2f} GB/s per GPU")  # fmt: skip
        ax.set_title(f"{d.model.name}, {d.gpus}x {d.gpu.name}", fontsize=9)
        ax.set_xlabel("cached prefix (tokens)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time for the prefix (s)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"model, not measurement: MFU {mfu}, {overhead_s * 1e3:.0f} ms per load",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mfu", type=float, default=0.5, help="prefill model-FLOPs utilisation")
    ap.add_argument("--overhead-ms", type=float, default=5.0, help="per load (lookup, claim)")
    ap.add_argument("--fast-gbps", type=float, default=10.0, help="a second bandwidth to show")
    ap.add_argument("--plot", help="draw recompute against load per deployment (PNG)")
    ap.add_argument(
        "--suite", help="a GPU suite's suite.json (default: the newest in docs/results/gpu_suite/)"
    )
    args = ap.parse_args(argv)
    measured = Measured.from_docs(args.suite)
    print(report(args.mfu, args.overhead_ms / 1e3, measured, args.fast_gbps))
    if args.plot:
        plot(args.plot, args.mfu, args.overhead_ms / 1e3, measured, args.fast_gbps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
