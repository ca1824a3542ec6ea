"""A request's path through the engine: ``admissions`` (a shared store's part, off the
model's thread), ``scheduler`` and ``worker`` (the model's one thread), ``steps`` (admit,
prefill, decode, finish), ``runner`` (the batched forward), ``forks`` (prompt prefixes
requests in flight share), ``text`` (the streamed reply), ``saves`` (the save thread) and
``commits`` (who hears each save)."""
