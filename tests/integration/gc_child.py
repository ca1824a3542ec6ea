"""A garbage collector killed at one step of its protocol (for the GC crash test): runs the
real ``Catalog.collect`` on a shared store's first collectable block (grace 0) and SIGKILLs
itself from inside the object delete it hands over, before or after deleting the object.

    python gc_child.py STORE_URL BLOCKS_URL FINGERPRINT before|after
"""

from __future__ import annotations

import os
import signal
import sys

from langchain_agent_memory.engine.storage.blocks import BlockHash
from langchain_agent_memory.engine.storage.catalog import Catalog
from langchain_agent_memory.engine.storage.objects import ObjectBlocks


def main() -> None:
    store, blocks, fingerprint, step = sys.argv[1:5]
    catalog, objects = Catalog(store), ObjectBlocks(blocks)
    for h in catalog.collectable(fingerprint, 0.0):
        key = objects.key(fingerprint, BlockHash(h))

        def delete(key: str = key) -> None:
            if step == "after":
                objects.delete(key)
            os.kill(os.getpid(), signal.SIGKILL)

        catalog.collect(fingerprint, h, 0.0, delete)
    print("nothing collectable", flush=True)


if __name__ == "__main__":
    main()
