"""The router's request tokenizer, one module per job (issue 43): a request's prompt token ids
exactly as a vLLM 0.33 engine computes them, and their chained KV-index keys, with a prefix cache
so that a growing conversation re-tokenizes only its new tail.

- ``request``: ``RequestTokenizer``, ``KeysPlan`` and ``load_tokenizer``, which put the rest
  together (what is and is not matched);
- ``loading``: the files found (a directory, the Hugging Face Hub) and read as transformers
  loads them;
- ``template``: a chat template rendered in transformers' Jinja setup as vLLM calls it;
- ``messages``: request bodies and chat messages normalized as vLLM hands them on;
- ``cuts``: where a text may be cut so its parts encode apart as it encodes whole;
- ``prefix_cache``: ids and keys from the longest cached prefix ending at a cut;
- ``errors``: ``TokenizerError``, on which the router falls back to its guessed index.

All but ``request`` and ``loading`` do no I/O (the no-I/O import-linter contract lists them).
"""
