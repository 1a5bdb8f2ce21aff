"""The fleet supervisor (``flatfare fleet``): one host's engines kept within its budget, models started,
woken, put to sleep or stopped on demand (contract item 8; docs/ARCHITECTURE.md, "Models on demand")."""
