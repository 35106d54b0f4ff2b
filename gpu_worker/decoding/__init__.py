"""Latents to images (and an edit's input image to latents): on the decoder
services (``decoders``), or on this sampler itself (``local_decode``)."""
