"""The HTTP front door's settings (``http_api/``): where it listens, which gateway
it speaks to, and how long the links to results it signs stay good."""

from __future__ import annotations

from dataclasses import dataclass

from services.config.fields import Section, setting


@dataclass(frozen=True)
class HttpSettings(Section):
    """The OpenAI-compatible HTTP API and the page (``http_api/``)."""

    host: str = setting("127.0.0.1", "Where the HTTP API listens.", env="HTTP_HOST")
    port: int = setting(8080, "The HTTP API's port; 0 picks a free one.", env="HTTP_PORT", at_least=0)
    gateway: str = setting(
        "127.0.0.1:50051", "The gRPC gateway it speaks to, host:port (`darkroom up`: its own).", env="HTTP_GATEWAY"
    )
    gateway_tls_ca: str = setting(
        "",
        "Reach the gateway over TLS, trusting this CA certificate (PEM); `system` trusts the system's. Empty: "
        "plaintext.",
        env="HTTP_GATEWAY_TLS_CA",
    )
    public_url: str = setting(
        "",
        "The base of the links it signs to results (https://images.example.com); empty: the scheme and host the "
        "request came to.",
        env="HTTP_PUBLIC_URL",
    )
    url_ttl_s: float = setting(
        3600.0, "How long a signed link to a result stays good.", env="HTTP_URL_TTL_S", at_least=1.0
    )
    url_key_file: str = setting(
        "",
        "A file holding the key links are signed with, shared by every HTTP replica (`darkroom up` makes one in "
        "DATA_DIR/secrets). Empty: a key of its own, made at start: its links die with the process.",
        env="HTTP_URL_KEY_FILE",
    )
    wait_s: float = setting(
        600.0,
        "How long a generation request waits for its job (less where an OpenAI SDK announces a shorter read "
        "timeout); past it the answer names the job to follow: an error (504, `job_running`), or a 202 for a request "
        "with `Prefer: respond-async, wait=N`.",
        env="HTTP_WAIT_S",
        at_least=1.0,
    )
    max_prompt_chars: int = setting(
        2000,
        "The gateway's longest prompt, read by the HTTP API from the same variable: a moderation's text longer than "
        "this is refused (400) before it is sent on.",
        env="MAX_PROMPT_CHARS",
        at_least=1,
    )
    max_input_mb: float = setting(
        16.0,
        "The gateway's limit on an input image (or mask), read by the HTTP API from the same variable: an edit's "
        "body may hold an image and its mask of this size, and 1 MiB of fields; a larger one is refused (413) as it "
        "arrives. A moderation's body (POST /v1/moderations, its images inline) may be as large again in base64. Every "
        "other route's body: 1 MiB.",
        env="MAX_INPUT_MB",
        at_least=0.01,
        at_most=24.0,
    )
    max_adapter_mb: float = setting(
        256.0,
        "The gateway's largest LoRA adapter upload, read by the HTTP API from the same variable: POST /v1/adapters's "
        "body may hold a file of this size and 1 MiB of fields; a larger one is refused (413) before a byte of it is "
        "read where its length is declared, else as it arrives.",
        env="MAX_ADAPTER_MB",
        at_least=0.01,
        at_most=8192.0,
    )
