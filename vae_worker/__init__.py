"""The decoder: latents in, encoded images out (``service``), concurrent requests
decoded in batches (``decode_batches``); ``metrics`` and ``spans`` report."""
