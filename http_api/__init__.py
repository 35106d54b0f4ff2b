"""The HTTP front door: OpenAI's images and videos APIs over Darkroom's jobs, for
the clients that already speak them. Read in this order:

- ``service``: ``main()``, ``serve()`` and ``create_app()``, errors as OpenAI's.
- ``routes``: each route, a client of the gRPC gateway with the caller's key.
- ``images``, ``videos``: OpenAI's requests as ``SubmitJobRequest`` and jobs as
  OpenAI's responses, pure.
- ``gateway_client``: the calls it makes to the gateway.
- ``errors``: the gateway's refusals as OpenAI's error JSON and HTTP status.
- ``signed_urls``: links to results that expire.
"""
