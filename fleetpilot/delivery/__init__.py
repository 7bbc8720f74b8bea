"""Model delivery: the download a Kubernetes Job runs to fill a shared model cache once per
model revision, so that engine pods start from the cache instead of fetching weights each.

- ``plan``: the rules, as pure functions (what to fetch, where a remote name may land, resume
  offsets, verification against the listing, the completion marker).
- ``hub``: a Hugging Face Hub repo at a revision into a Hub cache folder (``HF_HUB_CACHE``).
- ``s3``: every object under an S3-compatible ``s3://bucket/prefix`` into a folder.
- ``gc``: remove from a cache the downloads nothing keeps (other revisions' snapshots, blobs
  no kept snapshot links to, repos and S3 folders not kept), and nothing it did not write.
- ``cli``: ``fleetpilot model fetch hub|s3`` and ``fleetpilot model gc``.

Nothing here knows about Kubernetes or the operator: the operator decides when a Job runs
this and reads its outcome; this package only downloads, verifies and cleans up.
"""
