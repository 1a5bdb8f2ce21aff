"""SQL storage shared by the gateway, billing and the CLI: tables, sessions, key hashing."""
