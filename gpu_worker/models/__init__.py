"""The models a sampler holds: loaded on demand and evicted within a memory budget
(``model_cache``, by ``residency``'s rule), and, with a model store, its host's
cache of their blobs (``model_store``) and what the warm plan has fetched ahead
(``prefetch``)."""
