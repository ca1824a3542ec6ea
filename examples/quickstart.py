"""Two agents on the embedded default model, three turns each, with a per-turn
time-to-first-token table.

Each agent has its own system prompt of real text (>= 1K tokens): a licensing assistant
that holds the Apache License 2.0, and a Python tutor that holds three topics of the
Python reference manual. Every turn re-sends the whole conversation, as a chat app does;
the engine recognises the agent's earlier text and prefills only the new turn. Run it
twice: the second run starts warm, from the caches the first one left on disk.

    python examples/quickstart.py [--max-tokens 48] [--model smollm2-135m] [--fresh]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams


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
    ap.add_argument("--fresh", action="store_true", help="delete the agents' caches first")
    args = ap.parse_args()

    console = Console()
    with console.status("loading the model (converted once on first use)"):
        engine = Engine(args.model)
    lm = engine.lm
    console.print(
        f"model [bold]{lm.name}[/] loaded in {lm.load_seconds:.1f} s; KV caches in {engine.store.dir}"
    )

    table = Table(title="time to first token per turn")
    for col in ("agent", "turn", "prompt tokens", "reused", "cache", "TTFT s", "decode tok/s"):
        table.add_column(col, justify="right")
    team = agents()
    if args.fresh:
        for agent in team:
            engine.delete(f"quickstart:{agent.name}")
    params = GenerationParams(max_tokens=args.max_tokens)
    for turn in range(3):
        for agent in team:
            question = agent.questions[turn]
            agent.history.append({"role": "user", "content": question})
            messages = [{"role": "system", "content": agent.system}, *agent.history]
            prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            r = engine.generate(f"quickstart:{agent.name}", prompt, params)
            answer = r.text.strip()
            agent.history.append({"role": "assistant", "content": r.text})
            console.print(f"[bold]{agent.name}[/] turn {turn + 1}: {question}\n  -> {answer}")
            decode_tps = r.completion_tokens / r.timings.decode_s if r.timings.decode_s else 0.0
            table.add_row(
                agent.name,
                str(turn + 1),
                str(r.prompt_tokens),
                str(r.reused_tokens),
                str(r.outcome),
                f"{r.timings.ttft_s:.2f}",
                f"{decode_tps:.1f}",
            )
    console.print(table)


if __name__ == "__main__":
    main()
