"""The tiered model store: an S3-compatible object store holds every model version
(content-addressed: a manifest per version, blobs by SHA-256), each GPU host caches
what its samplers load, and hosts fetch from each other before the store."""
