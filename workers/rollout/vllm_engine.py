"""vLLM as a `RolloutEngine` (workers.rollout.protocol), for rollout workers on CUDA machines.

Selected with `rollout.backend: vllm` (the `vllm` extra). vLLM's AsyncLLM runs in the
rollout worker's process, on a private event loop in a daemon thread, so the worker
drives it exactly like the torch `Engine`:

    submit    -> one vLLM request per sequence (prompt token ids, DELTA outputs, logprob of
                 the sampled token), consumed by a task that queues each output
    step      -> waits briefly for outputs, applies them to the Sequences (only here, on the
                 caller's thread) and returns the finished ones
    interrupt -> abort every request; the sequences are held, tokens so far
    update    -> load the new version in each vLLM worker from the safetensors file the
                 trainer announced (`WeightLoader`, a worker extension), drop the prefix
                 cache, resubmit every held sequence's prompt + tokens so far; a LoRA
                 version (an adapter) becomes a LoRARequest instead (`_use_adapter`)

Outputs that arrive between the caller's last step and the abort were never seen by
it, so they are dropped and regenerated: every token a Sequence holds was produced by
the version recorded next to it.

Behaviour logprobs use vLLM's `processed_logprobs` mode: log_softmax of the logits the
sampler used, after temperature. Without top-k/top-p that is the torch engine's
convention; with them vLLM reports the truncated, renormalised distribution, where the
torch engine reports the tempered one before truncation. vLLM also stops at the
model's EOS on its own; `ignore_eos` leaves stopping to the request's stop tokens, as
in the torch engine. Stop strings are checked here, on the tokens step() applies
(`stop_cut`, the torch engine's check), not by vLLM: vLLM runs without its tokenizer,
and a string that completes across a resubmission after an update is still seen. The
request of a sequence that stopped so is aborted; tokens past the stop are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import shutil
import tempfile
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from workers.lora import is_adapter, write_adapter_dir
from workers.rollout.protocol import EngineStats, SamplingParams, Sequence, check_request, stop_cut
from workers.weight_deltas import ChainReader
from workers.weights import WeightsFile, file_metadata, missing, verified_bytes, verify, write_safetensors

POLL_S = 0.05  # how long step() waits for vLLM's next output before handing control back
INSTALL_HINT = (
    "rollout.backend 'vllm' needs vLLM, which is not installed here: "
    "`pip install 'asyncrl[vllm]'` on a CUDA machine, or use rollout.backend 'torch'"
)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds an adapter of `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.rank {rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def import_vllm():
    """vLLM, imported only when the backend is chosen; a clear error where it is missing."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return vllm


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls`): load one weight version in place.

    vLLM mixes this class into each of its GPU workers; `collective_rpc` calls the method
    on all of them, and the model's own `load_weights` shards the tensors as it loads.
    """

    def load_safetensors(self, path: str) -> int:
        from safetensors.torch import load_file

        weights = load_file(path)  # tied tensors are stored once; load_weights restores the ties
        self.model_runner.model.load_weights(weights=weights.items())
        return len(weights)


@dataclass
class Request:
    """The vLLM request currently generating `seq`; a resubmission replaces it."""

    seq: Sequence
    request_id: str
    version: int  # the weights it runs under
    task: Future  # the coroutine consuming its outputs, on the engine's loop


class VLLMEngine:
    """A `RolloutEngine` (workers.rollout.protocol) over vLLM's AsyncLLM. Call it from one thread at a time."""

    def __init__(
        self,
        model_path: str,
        *,
        max_batch: int = 64,
        version: int = 0,
        seed: int | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        lora_rank: int = 0,
    ):
        """`lora_rank` > 0: the run trains a LoRA adapter of that rank, and its versions are adapters (vLLM's LoRA)."""
        self.vllm = import_vllm()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)  # for stop strings (vLLM runs without its own)
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        self.async_llm, self.delta, self.lora_request = AsyncLLM, RequestOutputKind.DELTA, LoRARequest
        self.version = version
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine", daemon=True)
        self.thread.start()
        args = self.vllm.AsyncEngineArgs(
            model=model_path,
            max_num_seqs=max_batch,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.{WeightLoader.__name__}",
            **(dict(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1) if lora_rank else {}),
        )
        self.lora = None  # the LoRARequest of the newest adapter version; None: the base weights (version 0)
        self.adapters = Path(tempfile.mkdtemp(prefix="asyncrl-lora-")) if lora_rank else None  # their directories
        self.llm = self._run(self._create(args))
        self.max_batch, self.max_len = max_batch, max_model_len or self.llm.model_config.max_model_len
        self.vocab = self.llm.model_config.get_vocab_size()
        self.requests: dict[str, Request] = {}  # request id -> request, for every generating sequence
        self.held: list[Sequence] = []  # unfinished sequences without a request: interrupted, not yet resumed
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()  # (request id, CompletionOutput | Exception)
        self.counter = itertools.count()
        self.generated_tokens = self.weight_updates = self.interrupted = 0  # for stats()

    # ---- RolloutEngine ----

    def submit(self, key: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Start generating; the tokens show up in the Sequence through step()."""
        check_request(prompt_ids, params, self.max_len, self.vocab, self.tokenizer)
        if any(s.key == key for s in self.running()):
            raise ValueError(f"sequence {key!r} is already in the engine")
        seq = Sequence(key, list(prompt_ids), params)
        self._start(seq)
        return seq

    def running(self) -> list[Sequence]:
        return [r.seq for r in self.requests.values()] + self.held

    def idle(self) -> bool:
        return not self.requests and not self.held

    def step(self) -> list[Sequence]:
        """Apply every output vLLM produced since the last call (waiting up to POLL_S for one).

        Held sequences (an interruption without a weight update) resume first, on the
        current weights. Returns the sequences that finished; they have left the engine.
        """
        self._resume()
        try:
            arrived = [self.outputs.get(timeout=POLL_S)]
        except queue.Empty:
            return []
        while not self.outputs.empty():
            arrived.append(self.outputs.get_nowait())
        finished = []
        for request_id, out in arrived:
            request = self.requests.get(request_id)
            if request is None:  # an aborted request: its late outputs are void
                continue
            if isinstance(out, Exception):
                raise out
            seq, tokens, reason = request.seq, list(out.token_ids), out.finish_reason
            if reason is not None and reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM ended {seq.key!r} with {reason!r}")
            cut = stop_cut(seq.token_ids, tokens, seq.params.stop, self.tokenizer)
            if cut is not None:
                tokens, reason = tokens[:cut], "stop"
            seq.token_ids += tokens
            seq.logprobs += [options[tok].logprob for tok, options in zip(tokens, out.logprobs, strict=False)]
            seq.versions += [request.version] * len(tokens)
            self.generated_tokens += len(tokens)
            if reason is not None:
                seq.finish_reason = reason
                del self.requests[request_id]
                if out.finish_reason is None:  # stopped here, at a stop string: vLLM would go on
                    self._abort([request])
                finished.append(seq)
        return finished

    def interrupt(self) -> list[Sequence]:
        """Abort every request; every unfinished sequence, held until update_weights or the next step."""
        self._hold()
        self.interrupted += len(self.held)
        return list(self.held)

    def update_weights(self, weights: WeightsFile) -> None:
        """Load `weights` (a delta version: rebuilt and verified here, then written whole to a scratch file that
        vLLM reads) in place in every vLLM worker, then resubmit every held sequence (`_load`)."""
        if weights.base_version < 0:
            return self._load(weights)
        tensors = ChainReader().read(weights)  # the chain applied, the result's hash checked
        with tempfile.TemporaryDirectory() as scratch:
            path = Path(scratch) / f"v{weights.version:06d}.safetensors"
            with open(path, "wb") as stream:
                write_safetensors(tensors, stream, {"version": str(weights.version)})
            return self._load(WeightsFile(path, weights.version, weights.sha256))

    def _load(self, weights: WeightsFile) -> None:
        """Load `weights` in place in every vLLM worker, then resubmit each sequence's prompt plus its tokens so far.

        A missing file raises FileNotFoundError before anything is aborted; held sequences then resume on
        the old weights, as they do when the load itself fails.
        """
        try:
            if not Path(weights.path).is_file():
                raise FileNotFoundError(missing(weights.path, weights.version))
            if self.adapters is not None:  # an adapter: a few MB, read once, checked, and handed to vLLM as a LoRA
                self._use_adapter(verified_bytes(weights), weights.version)
            else:
                if weights.sha256 is not None:  # vLLM reads the file itself: checked here, then read again there
                    verify(weights.path, weights.sha256, weights.version)
                self._hold()
                self._run(self.llm.collective_rpc("load_safetensors", args=(str(weights.path),)))
            self._run(self.llm.reset_prefix_cache())  # cached blocks hold keys/values of the old weights
            self.version = weights.version
            self.weight_updates += 1
        finally:
            self._resume()

    def abort(self, key: str) -> Sequence | None:
        """Abort one sequence's request (or forget it, if held)."""
        request = next((r for r in self.requests.values() if r.seq.key == key), None)
        if request is not None:
            del self.requests[request.request_id]
            self._abort([request])
            return request.seq
        seq = next((s for s in self.held if s.key == key), None)
        if seq is not None:
            self.held.remove(seq)
        return seq

    def stats(self) -> EngineStats:
        running = len(self.requests) + len(self.held)
        return EngineStats(
            version=self.version,
            running=running,
            queued=max(0, running - self.max_batch),
            capacity=self.max_batch,
            generated_tokens=self.generated_tokens,
            weight_updates=self.weight_updates,
            interrupted=self.interrupted,
        )

    def close(self) -> None:
        self.llm.shutdown()
        if self.adapters is not None:
            shutil.rmtree(self.adapters, ignore_errors=True)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    # ---- vLLM side ----

    def _run(self, coro):
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _create(self, args):
        return self.async_llm.from_engine_args(args)  # inside the loop, so its output handler starts there

    def _use_adapter(self, data: bytes, version: int) -> None:
        """Make the adapter in `data` (a verified version file) the one every request from now on runs with: its
        PEFT directory written, loaded into vLLM (`add_lora`, new id per version), the previous one removed."""
        if not is_adapter(file_metadata(data)):
            raise ValueError(f"weights v{version}: a whole version, but this engine serves LoRA adapters")
        path = self.adapters / f"v{version:06d}"
        write_adapter_dir(data, path, self.llm.model_config.model)
        request = self.lora_request(f"v{version}", version + 1, str(path))  # ids must be > 0
        self._run(self.llm.add_lora(request))
        self._hold()
        previous, self.lora = self.lora, request
        if previous is not None:
            self._run(self.llm.remove_lora(previous.lora_int_id))
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _hold(self) -> None:
        """Abort every request, keeping its sequence as far as step() applied it."""
        live = list(self.requests.values())
        self.requests.clear()
        self._abort(live)
        self.held += [r.seq for r in live]

    def _resume(self) -> None:
        """Resubmit every held sequence, under the current weights."""
        held, self.held = self.held, []
        for seq in held:
            self._start(seq)

    def _abort(self, requests: list[Request]) -> None:
        """Stop requests already removed from `requests`: their late outputs are void in step()."""
        if requests:
            self._run(self.llm.abort([r.request_id for r in requests]))
        for request in requests:
            request.task.cancel()  # its generator is done after the abort

    def _start(self, seq: Sequence) -> None:
        """Submit `seq` (prompt + tokens so far) for the rest of its token budget."""
        request_id = f"{seq.key}#{next(self.counter)}"
        params = self.vllm.SamplingParams(
            temperature=seq.params.temperature,
            top_p=seq.params.top_p,
            top_k=seq.params.top_k,
            max_tokens=seq.params.max_new_tokens - len(seq.token_ids),
            stop_token_ids=list(seq.params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=self.delta,
        )
        prompt = self.vllm.TokensPrompt(prompt_token_ids=seq.prompt_ids + seq.token_ids)
        task = asyncio.run_coroutine_threadsafe(self._consume(request_id, prompt, params, self.lora), self.loop)
        self.requests[request_id] = Request(seq, request_id, self.version, task)

    async def _consume(self, request_id: str, prompt, params, lora) -> None:
        """Queue the request's outputs for step(); an error surfaces there, on the caller's thread."""
        try:
            async for out in self.llm.generate(prompt, params, request_id, lora_request=lora):
                self.outputs.put((request_id, out.outputs[0]))
        except Exception as exc:  # handed over, not swallowed
            self.outputs.put((request_id, exc))
