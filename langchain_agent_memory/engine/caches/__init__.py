"""The agents' caches: ``agents`` (where a request starts: lookup, load, cold start),
``reuse`` (the one reuse rule, ``plan_reuse``), ``hot_agents`` (the hot tier),
``cache_writes`` (commit and write), ``restore`` and ``block_cuts`` (blocks to layers and
back), ``agent_state`` and ``states`` (a hybrid model's snapshots)."""
