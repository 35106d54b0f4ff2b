"""The prompt processor: what is checked before a job is stored (the prompt filter,
at the gateway), what a prompt may become (expansion), and what is checked before
an output is stored (the image filter, in the decoder). ``docs/safety.md`` says
what each verdict does."""
