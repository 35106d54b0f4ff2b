"""The public gRPC front door (``service``): ``validation`` checks a submit,
``convert`` turns requests and records into messages, ``streams`` follows a job
for ``StreamJob``, ``auth`` checks API keys; ``metrics`` and ``spans`` report."""
