"""`asyncrl bench weights`: bytes written per version, and seconds to publish and to load it, whole vs delta.

The model (default: the imported SmolLM2-135M-Instruct) is loaded in float32, as the trainer holds it; one
real AdamW step (lr 5e-6 by default) on a few random-token sequences makes the next version; both are cast to
bfloat16, the published dtype. Whole: `write_version` (publish) and a verified read (load). Delta
(`workers.weight_deltas`): the publisher writes version 0 whole, then version 1 as a delta (publish: encode,
whole hash, write); a reader holding version 0 reads version 1 (load: read, apply, hash), and a reader holding
nothing rebuilds it from version 0's whole file. Files go to a scratch directory on the local disk and are
read back from the page cache: the seconds are the CPU's, not a shared file system's. LoRA adapters are
measured when the build has `model.lora` (another part of the same issue); otherwise the table says so.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from pipeline.bench import machine
from pipeline.model_cache import model_path
from schemas.config import ModelConfig
from workers.weight_deltas import BITS, ChainReader, Publisher
from workers.weights import WeightsFile, unique_state_dict, write_version


def two_versions(model_path: str, lr: float, sequences: int, length: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Versions 0 and 1 in bfloat16: the model as loaded, and after one AdamW step on random tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    snap = lambda: {n: t.to(torch.bfloat16) for n, t in unique_state_dict(model).items()}  # noqa: E731
    before = snap()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, model.config.vocab_size, (sequences, length), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()  # [sequences, length] tokens, their own labels
    optimizer.step()
    return [before, snap()]


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def measure(versions: list[dict[str, torch.Tensor]], scratch: Path) -> dict:
    """Bytes and seconds of version 1, whole and as a delta against version 0."""
    before, after = versions
    total = sum(t.numel() for t in after.values())
    changed = sum(int(torch.ne(before[n].view(BITS[2]), after[n].view(BITS[2])).sum()) for n in after)
    (path, digest), publish_whole = timed(lambda: write_version(after, scratch / "whole", 1, 2))
    _, load_whole = timed(lambda: ChainReader().read(WeightsFile(path, 1, digest)))
    publisher = Publisher(scratch / "delta", keep=2, whole_every=2)
    first = publisher.publish(before, 0)
    delta, publish_delta = timed(lambda: publisher.publish(after, 1))
    announced = WeightsFile(delta.path, 1, delta.sha256, delta.base_version)
    reader = ChainReader(retain=True)
    held = WeightsFile(first.path, 0, first.sha256)
    reader.hold(held, reader.read(held))
    _, load_delta = timed(lambda: reader.read(announced))
    _, rebuild = timed(lambda: ChainReader().read(announced))
    whole_bytes, delta_bytes = path.stat().st_size, delta.path.stat().st_size
    return {
        "elements": total,
        "fraction_changed": changed / total,
        "whole": {"bytes": whole_bytes, "publish_s": publish_whole, "load_s": load_whole},
        "delta": {"bytes": delta_bytes, "publish_s": publish_delta, "load_s": load_delta, "rebuild_s": rebuild},
        "delta_over_whole": delta_bytes / whole_bytes,
    }


def table(result: dict) -> str:
    whole, delta = result["whole"], result["delta"]
    lines = [
        "| version | bytes written | of a whole version | publish s | load s |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| whole (bf16) | {whole['bytes']:,} | 100 % | {whole['publish_s']:.2f} | {whole['load_s']:.2f} |",
        f"| delta against the version before | {delta['bytes']:,} | {100 * result['delta_over_whole']:.1f} % "
        f"| {delta['publish_s']:.2f} | {delta['load_s']:.2f} (from its whole version: {delta['rebuild_s']:.2f}) |",
        f"| LoRA adapter | {result['lora']} | | | |",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    versions = two_versions(model_path(args.model), args.lr, args.sequences, args.length, args.seed)
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        result = measure(versions, Path(scratch))
    lora = "lora" in ModelConfig.__struct_fields__
    result["lora"] = "not measured: model.lora is in this build, its bench is not" if lora else "not in this build"
    result |= {"model": args.model, "lr": args.lr, "sequences": args.sequences, "length": args.length}
    print(f"fraction of elements changed by one step: {100 * result['fraction_changed']:.2f} %")
    print(table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result | {"machine": machine()}, indent=2) + "\n")
    return 0
