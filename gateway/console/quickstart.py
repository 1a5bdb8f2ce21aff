"""The quick-start page: the customer's base URL and SDK snippets for a chat model their plan allows (the
platform's default chat model unless another is picked; never an embedding model, which chat refuses)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from flatfare.gateway.console.deps import KeysMember
from flatfare.gateway.console.plan_models import plan_models
from flatfare.gateway.console.pages import render
from flatfare.gateway.app_state import services_of

router = APIRouter(prefix="/console", include_in_schema=False)


def snippets(base_url: str, model: str) -> dict[str, str]:
    """curl, Python and JavaScript, each reading the key from FLATFARE_API_KEY (never pasted inline)."""
    return {
        "curl": f"""curl {base_url}/chat/completions \\
  -H "Authorization: Bearer $FLATFARE_API_KEY" \\
  -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'""",
        "python": f"""# pip install openai
import os
from openai import OpenAI

client = OpenAI(base_url="{base_url}", api_key=os.environ["FLATFARE_API_KEY"])
reply = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "Hello!"}}],
)
print(reply.choices[0].message.content)""",
        "javascript": f"""// npm install openai
import OpenAI from "openai";

const client = new OpenAI({{ baseURL: "{base_url}", apiKey: process.env.FLATFARE_API_KEY }});
const reply = await client.chat.completions.create({{
  model: "{model}",
  messages: [{{ role: "user", content: "Hello!" }}],
}});
console.log(reply.choices[0].message.content);""",
    }


@router.get("/quickstart")
async def quickstart(request: Request, customer: KeysMember) -> Response:
    settings = services_of(request).settings
    # The operator's public URL when set; otherwise the address this page was reached at.
    public = settings.public_url if "public_url" in settings.model_fields_set else str(request.base_url)
    base_url = public.rstrip("/") + "/v1"
    models = await plan_models(request, customer.account, chat=True)
    model = request.query_params.get("model")
    if model not in models:
        model = models[0] if models else "MODEL"
    return render(request, "quickstart.html", {"customer": customer, "base_url": base_url, "models": models,
                                               "model": model, "snippets": snippets(base_url, model)})
