"""A process whose engine answers agents' turns in a loop, each turn's save running on the
engine's save thread after the reply left, until it is killed (``test_crash_safety.py``).

Journal (JSON lines): before each turn ``{"agent", "turn", "prompt"}``; after each
``Engine.flush`` ``{"flushed": {agent: turn}}`` (every save up to those turns is durable).

    python background_save_child.py CACHE_DIR JOURNAL SEED
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.engine import Engine, GenerationParams

AGENTS = ["writer", "critic ü", "t1:map#2"]


def main(cache_dir: str, journal_path: str, seed: int) -> None:
    rng = random.Random(seed)
    engine = Engine("smollm2-135m", cache_dir=cache_dir)
    journal = Path(journal_path).open("a")  # noqa: SIM115 (open until the kill)

    def log(**entry: object) -> None:
        journal.write(json.dumps(entry) + "\n")
        journal.flush()

    text = corpus.apache_license()
    turns = {a: 0 for a in AGENTS}
    print("ready", flush=True)
    while True:
        agent = rng.choice(AGENTS)
        turns[agent] += 1
        start = rng.randrange(0, 2000)
        prompt = engine.admin.cached_text(agent) or text[start : start + 600]
        prompt += f"\n\nQ{turns[agent]}: {text[start + 600 : start + 600 + rng.randrange(50, 700)]}\nA:"
        log(agent=agent, turn=turns[agent], prompt=prompt)
        engine.generate(agent, prompt, GenerationParams(max_tokens=4))
        if rng.random() < 0.3:
            engine.flush()
            log(flushed=dict(turns))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
