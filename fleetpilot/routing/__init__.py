"""The fleetpilot router: picks a model tier by request complexity and a replica by prefix-cache
affinity and load, then proxies the OpenAI request (streamed or not) to it.

Layout: ``policies/`` and ``features`` are pure (plain data in, plain data out). The decision
does no I/O either: ``router`` runs the policies over state it asks of its owners - ``replica``
and ``replica_set`` (each replica's counts and marks, the groups discovery published),
``affinity`` (the prefix-cache evidence: KV index, recent sends, guessed index, tokenizers),
``adapter_holders``, ``tiers`` (a request's tier, resolved once) and ``group_picks`` (views and
picks); ``endpoints`` holds the pure endpoint types, ``route`` the decision. ``proxy``,
``scrape``, ``health``, ``discovery`` and ``app`` do the I/O around them.
"""
