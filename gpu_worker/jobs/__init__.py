"""A batch of started jobs from RUNNING to its stored outcomes: the ``runner``
(start, sample, decode, finish) and the batch on the device as it sees it
(``batch_sampling``); what each job needs before its first step (``edit_inputs``),
its steps and previews reported (``progress``, ``previews``), why it must stop
(``tracker``), and what it comes to (``outcomes``, ``failures``), written fenced by
its attempt (``job_store``)."""
