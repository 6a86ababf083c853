"""The request path, backend-independent: a request's life from prompt to result.

``prepare`` (tokenize, images, layout, settings) → ``step`` (admit, claim or reuse a cached
prefix, pack, run, release) → ``sampling`` → ``commit`` (tokens, text, stops, events);
``scheduler`` drives steps for many callers, ``prefix`` keeps reusable KV blocks.
"""
