"""The tiered model store's settings (``services/models/store``): the object store
that holds every model version (the truth), each host's disk cache in front of it,
and the peers asked before it. docs/operations.md explains the three tiers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.config.fields import Section, SettingsError, setting


@dataclass(frozen=True)
class ModelStoreSettings(Section):
    """Where ``store:`` models come from and where a host keeps them."""

    model_store_url: str = setting(
        "",
        "The S3-compatible object store holding the models pushed with `darkroom models push`, as "
        "http://host:port or https://host:port; empty: no store (a registry naming a store: source is refused). "
        "`darkroom up --model-store` starts one and sets it.",
    )
    model_store_bucket: str = setting("darkroom-models", "The store's bucket.")
    model_store_region: str = setting("us-east-1", "The store's region, as its S3 signatures name it.")
    model_store_access_key: str = setting(
        "",
        "The access key id this process reads the store with. A decoder's may read the bucket, nothing more; a "
        "sampler's may also write compiled artifacts (compiled/); a gateway's may read manifests and keep tenants' "
        "adapters (tenants/): docs/security.md. Empty: requests are not signed.",
    )
    model_store_secret_key: str = setting("", "The secret key of DARKROOM_MODEL_STORE_ACCESS_KEY.")
    model_store_sampler_access_key: str = setting(
        "",
        "For `darkroom up` and `darkroom supervise`: the identity they give their samplers as "
        "DARKROOM_MODEL_STORE_ACCESS_KEY (it may also write compiled/). Empty: samplers get "
        "DARKROOM_MODEL_STORE_ACCESS_KEY, the decoders' own.",
    )
    model_store_sampler_secret_key: str = setting("", "The secret key of DARKROOM_MODEL_STORE_SAMPLER_ACCESS_KEY.")
    model_store_gateway_access_key: str = setting(
        "",
        "For `darkroom up`: the identity it gives its gateway as DARKROOM_MODEL_STORE_ACCESS_KEY (it may read "
        "manifests and write tenants/, nothing else). Empty: the gateway gets nothing of the store (it then "
        "resolves no adapter and takes no upload).",
    )
    model_store_gateway_secret_key: str = setting("", "The secret key of DARKROOM_MODEL_STORE_GATEWAY_ACCESS_KEY.")
    model_store_writer_access_key: str = setting(
        "",
        "The access key id `darkroom models` (push, rm, list) signs with: an identity that may also write the "
        "bucket. The operator's alone: `darkroom up` and `darkroom supervise` give it to no service. Empty: it "
        "signs with DARKROOM_MODEL_STORE_ACCESS_KEY.",
    )
    model_store_writer_secret_key: str = setting("", "The secret key of DARKROOM_MODEL_STORE_WRITER_ACCESS_KEY.")
    model_cache_dir: str = setting(
        "",
        "The host's model cache: blobs by digest and each model version's directory, shared by the samplers of "
        "the host (one download per host). Empty: DATA_DIR/model-cache.",
    )
    model_cache_gb: float = setting(
        200.0,
        "The most the cache holds, in GB; past it the least recently used models that no sampler holds are evicted.",
        at_least=0.001,
    )
    model_cache_verify_hours: float = setting(
        24.0,
        "How often a host's cache is hashed again whole (by one of its samplers): a blob that rotted on disk is "
        "deleted with the directories linking it and fetched again at the next load; 0: never (`darkroom models "
        "verify` checks at once).",
        at_least=0.0,
    )
    model_fetch_streams: int = setting(
        8, "Ranged reads in flight at once while a blob is fetched from the store or a peer.", at_least=1, at_most=256
    )
    model_fetch_range_mb: int = setting(
        16, "The size of each ranged read from the store or a peer, in MB.", at_least=1, at_most=1024
    )
    model_peers: bool = setting(
        True,
        "Ask the peers (other hosts' samplers, over the mesh) that hold a blob before the object store; off: the "
        "store alone.",
    )
    model_peer_min_mbps: float = setting(
        1.0,
        "The least a peer must send, in MB/s on average after its first 10 s, before a fetch gives it up and goes "
        "on from the next peer or the store with the bytes it has; 0: no minimum (a peer idle for 10 s is still "
        "given up).",
        at_least=0.0,
    )

    def check(self) -> None:
        if self.model_store_url and not self.model_store_url.startswith(("http://", "https://")):
            raise SettingsError(
                f"DARKROOM_MODEL_STORE_URL={self.model_store_url!r}: must start with http:// or https://"
            )
        for prefix, access, secret in (
            ("DARKROOM_MODEL_STORE_", self.model_store_access_key, self.model_store_secret_key),
            ("DARKROOM_MODEL_STORE_WRITER_", self.model_store_writer_access_key, self.model_store_writer_secret_key),
            ("DARKROOM_MODEL_STORE_SAMPLER_", self.model_store_sampler_access_key, self.model_store_sampler_secret_key),
            ("DARKROOM_MODEL_STORE_GATEWAY_", self.model_store_gateway_access_key, self.model_store_gateway_secret_key),
        ):
            if bool(access) != bool(secret):
                raise SettingsError(f"{prefix}ACCESS_KEY and {prefix}SECRET_KEY are set together, or neither")

    def as_writer(self) -> ModelStoreSettings:
        """These settings signing as the writer (`darkroom models`), where one is set."""
        if not self.model_store_writer_access_key:
            return self
        return replace(
            self,
            model_store_access_key=self.model_store_writer_access_key,
            model_store_secret_key=self.model_store_writer_secret_key,
        )
