"""The agents' caches: ``agents`` (where a request starts: lookup, load, shared start),
``prefix_index`` (the one reuse authority: every known block by chained hash, and
``longest_prefix``), ``hot_agents`` (the hot tier),
``cache_writes`` (commit and write), ``restore`` and ``block_cuts`` (blocks to layers and
back), ``agent_state`` and ``states`` (a hybrid model's snapshots)."""
