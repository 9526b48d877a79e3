"""Engine throughput on CPU: pdserve's ``LLMEngine`` against transformers' ``generate``.

Both sides load the same Hugging Face Llama checkpoint (a pdserve preset's weights
copied into ``transformers.LlamaForCausalLM`` and saved with ``save_pretrained``) and
run greedy generation on the same random prompts. Each side runs in its own
subprocess, so each peak RSS is that side's alone.

Definitions, for a batch of B prompts of P tokens and N new tokens each:

- TTFT: from submitting the batch until every request has its first token. Both
  sides compute the whole batch's prefill in one forward pass (pdserve's token
  budget is raised to B×P so that it does not chunk).
- prefill tok/s = B×P / TTFT
- decode tok/s = B×(N−1) / (total − TTFT): the tokens generated after the first,
  over the time spent generating them.

Peak RSS of the engine process (``resource.getrusage``) is set against the bytes of
the weights plus the KV cache budget; the difference is the overhead (Python, torch
libraries, activations, allocator slack).

    .venv/bin/python benchmarks/engine_throughput.py            # full run
    .venv/bin/python benchmarks/engine_throughput.py --quick    # a short check
    python benchmarks/engine_throughput.py --device cuda --dtype bfloat16 --batch-sizes 1,8,32,128

On CUDA both sides run on the GPU in the chosen dtype, and peak memory is
``torch.cuda.max_memory_allocated`` instead of the process's RSS. The engine turns
PyTorch's cuDNN attention backend off on CUDA (``pdserve/engine/device.py``);
transformers keeps PyTorch's default unless ``--hf-without-cudnn-attention``.
``--json PATH`` writes the table's figures and the token comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="pdserve preset to benchmark")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="cpu | cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--hf-without-cudnn-attention", action="store_true",
                        help="transformers side: turn off PyTorch's cuDNN attention, as the engine does")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quick", action="store_true",
                        help="batch 1 and 8, 64-token prompts, 16 new tokens")
    parser.add_argument("--worker", choices=["checkpoint", "pdserve", "transformers"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.prompt_len, args.new_tokens = "1,8", 64, 16
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (decode needs tokens after the first)")
    return args


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(batch_size * 1000 + prompt_len)
    return [[rng.randrange(vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)]


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def peak_bytes(device: str) -> int:
    """The side's peak memory: the GPU's allocations on CUDA, else the process's RSS."""
    if device.startswith("cuda"):
        import torch
        return torch.cuda.max_memory_allocated(device)
    return rss_bytes()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(device)


# -- the checkpoint ---------------------------------------------------------------------


def build_checkpoint(preset: str, path: Path) -> None:
    """Copy a pdserve preset's weights into ``LlamaForCausalLM`` and save it to ``path``."""
    import torch
    import transformers

    from pdserve.engine.loader import load_model

    ours, _ = load_model(preset)
    cfg = ours.config
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    state = {
        "model.embed_tokens.weight": ours.embed_tokens,
        "model.norm.weight": ours.norm.weight,
        # A tied head (SmolLM2) is the embedding; saved as its own tensor all the same.
        "lm_head.weight": ours.embed_tokens if ours.lm_head is None else ours.lm_head,
    }
    for i, layer in enumerate(ours.layers):
        attn, mlp, prefix = layer.self_attn, layer.mlp, f"model.layers.{i}."
        q, k, v = attn.qkv_weight.split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = mlp.gate_up_weight.split(mlp.intermediate)
        state.update({
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": attn.o_weight,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": mlp.down_weight,
            prefix + "input_layernorm.weight": layer.input_layernorm.weight,
            prefix + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        })
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict({k: t.contiguous().clone() for k, t in state.items()}, assign=True)
    hf.save_pretrained(path, safe_serialization=True)


# -- the two sides ------------------------------------------------------------------------


def run_pdserve(args: argparse.Namespace) -> dict:
    from pdserve.api.sampling import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    start_rss = rss_bytes()
    max_bs, seq_len = max(args.batch_sizes), args.prompt_len + args.new_tokens
    engine = LLMEngine(EngineConfig(
        model=args.checkpoint, block_size=BLOCK_SIZE, num_threads=args.threads,
        device=args.device, dtype=args.dtype,
        num_kv_blocks=max_bs * math.ceil(seq_len / BLOCK_SIZE),
        max_num_seqs=max_bs, max_num_batched_tokens=max(2048, max_bs * args.prompt_len),
        enable_prefix_caching=False,
    ))
    model = engine.runner.model
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = engine.model_config.vocab_size

    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list]:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        ttft = None
        while engine.has_unfinished:
            engine.step()
            if ttft is None and all(r.output_token_ids for r in reqs):
                ttft = time.perf_counter() - t0
        return ttft, time.perf_counter() - t0, [r.output_token_ids for r in reqs]

    generate(make_prompts(2, 32, vocab), 4)  # warm-up
    rows = {}
    for bs in args.batch_sizes:
        ttft, total, outputs = generate(make_prompts(bs, args.prompt_len, vocab), args.new_tokens)
        rows[bs] = dict(ttft_s=ttft, total_s=total, outputs=outputs)
    return dict(rows=rows, peak_rss_bytes=peak_bytes(args.device), start_rss_bytes=start_rss,
                weights_bytes=weights_bytes, kv_cache_bytes=engine.runner.kv_cache_bytes)


def run_transformers(args: argparse.Namespace) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    if args.hf_without_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)
    start_rss = rss_bytes()
    model = transformers.LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=getattr(torch, args.dtype))
    model.to(args.device).eval()
    vocab = model.config.vocab_size

    class FirstTokenClock(transformers.LogitsProcessor):
        """Called once per step after the forward pass: the first call ends the prefill."""

        def __init__(self) -> None:
            self.first_s: float | None = None

        def __call__(self, input_ids, scores):
            if self.first_s is None:
                sync(args.device)
                self.first_s = time.perf_counter()
            return scores

    @torch.inference_mode()
    def generate(prompts: list[list[int]], new_tokens: int) -> tuple[float, float, list]:
        clock = FirstTokenClock()
        t0 = time.perf_counter()
        ids = torch.tensor(prompts, device=args.device)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
            eos_token_id=None, logits_processor=transformers.LogitsProcessorList([clock]),
        )
        sync(args.device)
        total = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + new_tokens
        return clock.first_s - t0, total, out[:, ids.shape[1]:].tolist()

    generate(make_prompts(2, 32, vocab), 4)  # warm-up
    rows = {}
    for bs in args.batch_sizes:
        ttft, total, outputs = generate(make_prompts(bs, args.prompt_len, vocab), args.new_tokens)
        rows[bs] = dict(ttft_s=ttft, total_s=total, outputs=outputs)
    return dict(rows=rows, peak_rss_bytes=peak_bytes(args.device), start_rss_bytes=start_rss)


# -- the report ------------------------------------------------------------------------------


def rates(row: dict, bs: int, args: argparse.Namespace) -> tuple[float, float]:
    prefill = bs * args.prompt_len / row["ttft_s"]
    decode = bs * (args.new_tokens - 1) / (row["total_s"] - row["ttft_s"])
    return prefill, decode


def report(args: argparse.Namespace, ours: dict, theirs: dict) -> list[dict]:
    """Print the table and the memory lines; return the table's rows."""
    mib = 2**20
    hf_attention = ", transformers without cuDNN attention" if args.hf_without_cudnn_attention else ""
    print(f"\nmodel={args.model} prompt_len={args.prompt_len} new_tokens={args.new_tokens} "
          f"threads={args.threads} ({args.device}, {args.dtype}, greedy{hf_attention})\n")
    header = ("| batch | pdserve TTFT ms | HF TTFT ms | pdserve prefill tok/s | HF prefill tok/s "
              "| pdserve decode tok/s | HF decode tok/s | decode ratio "
              "| same tokens (prompts; first difference at) |")
    print(header)
    print("|" + "|".join("---:" for _ in range(header.count("|") - 1)) + "|")
    table = []
    for bs in args.batch_sizes:
        o, t = ours["rows"][str(bs)], theirs["rows"][str(bs)]
        op, od = rates(o, bs, args)
        tp, td = rates(t, bs, args)
        same = same_tokens(o["outputs"], t["outputs"])
        print(f"| {bs} | {o['ttft_s'] * 1e3:,.1f} | {t['ttft_s'] * 1e3:,.1f} | {op:,.0f} | {tp:,.0f} "
              f"| {od:,.0f} | {td:,.0f} | {od / td:.2f}x | {same} |")
        table.append(dict(batch=bs, pdserve_ttft_s=o["ttft_s"], hf_ttft_s=t["ttft_s"],
                          pdserve_prefill_tok_s=op, hf_prefill_tok_s=tp,
                          pdserve_decode_tok_s=od, hf_decode_tok_s=td, same_tokens=same))
    budget = ours["weights_bytes"] + ours["kv_cache_bytes"]
    peak = ours["peak_rss_bytes"]
    where = "GPU memory allocated" if args.device.startswith("cuda") else "RSS"
    print(f"\npdserve engine peak {where}: {peak / mib:,.0f} MiB; weights "
          f"{ours['weights_bytes'] / mib:,.0f} MiB + KV budget {ours['kv_cache_bytes'] / mib:,.0f} MiB"
          f" = {budget / mib:,.0f} MiB; overhead {(peak - budget) / mib:,.0f} MiB "
          f"({ours['start_rss_bytes'] / mib:,.0f} MiB of it is Python and torch before loading)")
    print(f"transformers peak {where}: {theirs['peak_rss_bytes'] / mib:,.0f} MiB")
    return table


def same_tokens(ours: list[list[int]], theirs: list[list[int]]) -> str:
    """How many prompts got the same greedy tokens, and where the first that did not
    went apart (bfloat16 may round two near-equal logits the other way)."""
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True))
    apart = [next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
             for a, b in zip(ours, theirs, strict=True) if a != b]
    return f"{equal}/{len(ours)}" + (f"; token {min(apart)}" if apart else "")


def run_worker(side: str, args: argparse.Namespace, checkpoint: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--checkpoint", str(checkpoint),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--threads", str(args.threads), "--model", args.model,
           "--device", args.device, "--dtype", args.dtype]
    if args.hf_without_cudnn_attention:
        cmd.append("--hf-without-cudnn-attention")
    print(f"{side} ...", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"error: the {side} worker exited with {done.returncode} (its error is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker == "checkpoint":
        from pdserve.engine.config import ConfigError
        from pdserve.engine.device import prepare_device
        try:
            prepare_device(args.device)  # a missing device fails here, before either side runs
        except ConfigError as e:
            sys.exit(f"error: {e}")
        build_checkpoint(args.model, Path(args.checkpoint))
        print(json.dumps({}))
        return
    if args.worker:
        run = run_pdserve if args.worker == "pdserve" else run_transformers
        print(json.dumps(run(args)))
        return
    # This process stays small (no torch): a child inherits its parent's peak RSS
    # across fork and exec, which would inflate the engine's number.
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        checkpoint = Path(tmp) / args.model
        run_worker("checkpoint", args, checkpoint)
        ours = run_worker("pdserve", args, checkpoint)
        theirs = run_worker("transformers", args, checkpoint)
    table = report(args, ours, theirs)
    if args.json:
        keep = ("peak_rss_bytes", "weights_bytes", "kv_cache_bytes")
        Path(args.json).write_text(json.dumps(dict(
            args={k: v for k, v in vars(args).items() if k not in ("worker", "checkpoint")},
            rows=table, pdserve={k: ours[k] for k in keep},
            transformers={"peak_rss_bytes": theirs["peak_rss_bytes"]},
        ), indent=1))


if __name__ == "__main__":
    main()
