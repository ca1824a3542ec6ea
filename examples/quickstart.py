"""Two agents on the embedded default model, three turns each, with a per-turn
time-to-first-token table.

Each agent has its own system prompt of real text (>= 1K tokens): a licensing assistant
that holds the Apache License 2.0, and a Python tutor that holds three topics of the
Python reference manual. Every turn re-sends the whole conversation, as a chat app does.

    python examples/quickstart.py [--max-tokens 48] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.models import load_model


@dataclass
class Agent:
    name: str
    system: str
    questions: list[str]
    history: list[dict[str, str]] = field(default_factory=list)


def agents() -> list[Agent]:
    lic = corpus.apache_license()
    py = "\n\n".join(corpus.python_docs_topic(t) for t in ("assert", "for", "exceptions"))
    return [
        Agent(
            "licensing",
            "You are a licensing assistant. Answer briefly, using this license text:\n\n" + lic,
            [
                "What is the name of this license?",
                "Can I use the licensed work commercially?",
                "Do I have to keep the copyright notice?",
            ],
        ),
        Agent(
            "python-tutor",
            "You are a Python tutor. Answer briefly, using this part of the Python reference:\n\n" + py,
            [
                "What does the assert statement do?",
                "Write a for loop that prints the numbers 0 to 2.",
                "What happens when an exception is not handled?",
            ],
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="shipped model name or mlx-lm directory")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    console = Console()
    with console.status("loading the model (converted once on first use)"):
        lm = load_model(args.model)
    console.print(f"model [bold]{lm.name}[/] loaded in {lm.load_seconds:.1f} s from {lm.path}")

    table = Table(title="time to first token per turn (full prefill every turn)")
    for col in ("agent", "turn", "prompt tokens", "TTFT s", "prefill tok/s", "decode tok/s"):
        table.add_column(col, justify="right")
    team = agents()
    for turn in range(3):
        for agent in team:
            question = agent.questions[turn]
            agent.history.append({"role": "user", "content": question})
            messages = [{"role": "system", "content": agent.system}, *agent.history]
            prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = lm.tokenizer.encode(prompt, add_special_tokens=False)
            t0 = time.perf_counter()
            ttft, text, last = None, "", None
            for resp in stream_generate(
                lm.model, lm.tokenizer, ids, max_tokens=args.max_tokens, sampler=make_sampler(temp=0.0)
            ):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text += resp.text
                last = resp
            answer = text.strip()
            agent.history.append({"role": "assistant", "content": answer})
            console.print(f"[bold]{agent.name}[/] turn {turn + 1}: {question}\n  -> {answer}")
            assert last is not None and ttft is not None
            table.add_row(
                agent.name,
                str(turn + 1),
                str(len(ids)),
                f"{ttft:.2f}",
                f"{last.prompt_tps:.0f}",
                f"{last.generation_tps:.1f}",
            )
    console.print(table)


if __name__ == "__main__":
    main()
