"""The public gRPC front door (``service``): ``auth`` finds the caller's tenant from
its API key, ``validation`` checks a submit, ``convert`` turns requests and records
into messages, ``pages`` pages ``ListJobs``, ``streams`` follows a job for
``StreamJob``; ``metrics`` and ``spans`` report."""
