"""The HTTP front door: OpenAI's images API over Darkroom's jobs, for the clients
that already speak it. Read in this order:

- ``service``: ``main()``, ``serve()`` and ``create_app()``, the routes.
- ``images``: an OpenAI images request as a ``SubmitJobRequest``, and a job as
  OpenAI's images response.
- ``gateway_client``: the calls it makes to the gRPC gateway, the caller's key passed on.
- ``errors``: the gateway's refusals as OpenAI's error JSON and HTTP status.
- ``signed_urls``: links to results that expire.
"""
