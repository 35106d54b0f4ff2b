"""A job's denoising state at a step boundary, out to the database and back in on
any GPU: taken from and put back into a running member (``capture``), as bytes
(``format``), and stored as the sampler hands them over (``writer``)."""
