"""`asyncrl bench head`'s parts: the micro-batch it measures, its full-vocabulary baseline and one timing run,
on a tiny model (the real one runs only in the bench itself)."""

import torch

from pipeline.bench import head
from tests.factories import tiny_qwen2
from workers.trainer.packing import pack
from workers.trainer.step import packed_logprobs

torch.set_num_threads(1)


def test_the_micro_batch_is_two_groups_of_eight_after_a_shared_prompt():
    batch = head.micro_batch(300, vocab=16)
    completion = (300 // head.GROUPS - head.PROMPT) // head.SAMPLES  # 7 tokens each
    assert batch.input_ids.shape == (head.GROUPS * head.SAMPLES, head.PROMPT + completion)
    assert batch.prompt_lengths.tolist() == [head.PROMPT] * 16
    packed = pack(batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    assert packed.input_ids.shape[1] == head.GROUPS * (head.PROMPT + head.SAMPLES * completion) == 292


def test_the_baseline_computes_what_the_trainer_does():
    model, batch = tiny_qwen2(max_position_embeddings=128), head.micro_batch(220, vocab=16)
    want, want_entropy, want_work = packed_logprobs(model, batch, 0.8)
    got, entropy, work = head.full_vocabulary_logprobs(model, batch, 0.8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-6)
    assert work == want_work and work[2] == 2 * (1 + 8)  # the head at each group's last prompt position and
    # at each row's first completion token (of 2): the full vocabulary's extra positions are not model FLOPs


def test_a_timing_run_alternates_both_methods(tmp_path):
    tiny_qwen2(max_position_embeddings=128).save_pretrained(tmp_path)
    given = dict(model=str(tmp_path), tokens=220, dtype="float32", threads=1, repeats=2)
    times = head.measure_time(given)
    assert set(times) == set(head.METHODS)
    for run in times.values():
        assert len(run["seconds"]) == len(run["cpu_seconds"]) == 2
        assert run["seconds_min"] == min(run["seconds"]) > 0
