"""The public gRPC front door (``service``): ``auth`` finds the caller's tenant from
its API key, ``names`` holds a call's ids and names to their lengths, ``validation``
checks a submit, ``convert`` turns requests and records into messages, ``pages``
pages ``ListJobs``, ``streams`` follows a job for ``StreamJob``; ``metrics`` and
``spans`` report."""
