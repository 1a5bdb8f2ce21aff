"""OpenAI's Responses API (``/v1/responses``): the request runs through vLLM's own Responses serving in
a worker like any job kind; what it stores (responses, and the conversation a later request continues)
lives in Flatfare's database, owned by the account."""
