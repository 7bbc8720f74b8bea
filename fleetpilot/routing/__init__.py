"""The fleetpilot router: picks a model tier by request complexity and a replica by prefix-cache
affinity and load, then proxies the OpenAI request (streamed or not) to it.

Layout: ``policies/`` and ``features`` are pure (plain data in, plain data out); ``router``
holds the mutable per-replica state the policies read; ``proxy``, ``scrape``, ``health``,
``discovery`` and ``app`` do the I/O around them.
"""
