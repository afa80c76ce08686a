"""Forty agent tools as OpenAI `tools` entries, modelled on the tool sets agents really send
(coding agents' file and shell tools, MCP servers for git, GitHub, Slack, calendars, databases,
Kubernetes, browsers): nested objects, arrays of objects, enums, consts, nullable types, `$ref`
with `$defs`, `anyOf`, `additionalProperties: false`. The grammar bench forces a call over all
of them; the server tests check that every one compiles. No keyword llguidance ignores (such as
uniqueItems), so a strict compile (the bench's baseline on older code) builds them too.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _s(desc: str = "", **kw: Any) -> Schema:
    return {"type": "string", **({"description": desc} if desc else {}), **kw}


def _i(desc: str = "", **kw: Any) -> Schema:
    return {"type": "integer", **({"description": desc} if desc else {}), **kw}


def _b(desc: str = "") -> Schema:
    return {"type": "boolean", **({"description": desc} if desc else {})}


def _e(*values: str) -> Schema:
    return {"type": "string", "enum": list(values)}


def _a(items: Schema, **kw: Any) -> Schema:
    return {"type": "array", "items": items, **kw}


def _o(props: dict[str, Schema], required: tuple[str, ...] = (), closed: bool = True, **kw: Any) -> Schema:
    out: Schema = {"type": "object", "properties": props, "required": list(required), **kw}
    if closed:
        out["additionalProperties"] = False
    return out


def _null(schema: Schema) -> Schema:
    return {**schema, "type": [schema["type"], "null"]}


_PERSON = _o({"name": _s(), "email": _s(format="email")}, ("email",))
_RANGE = _o({"start": _s("ISO 8601", format="date-time"), "end": _s(format="date-time")}, ("start", "end"))
_FILTER = _o({"field": _s(), "op": _e("eq", "ne", "lt", "gt", "in", "contains"),
              "value": {"anyOf": [_s(), {"type": "number"}, _b(), _a(_s())]}}, ("field", "op", "value"))
_CONTAINER = _o({"name": _s(), "image": _s(), "env": _a(_o({"name": _s(), "value": _s()}, ("name", "value"))),
                 "ports": _a(_o({"containerPort": _i(minimum=1, maximum=65535),
                                 "protocol": _e("TCP", "UDP")}, ("containerPort",)))}, ("name", "image"))

_TOOLS: list[tuple[str, str, Schema]] = [
    ("read_file", "Read a file from the workspace", _o({"path": _s("absolute path"), "offset": _i(minimum=0),
                                                        "limit": _i(minimum=1, maximum=2000)}, ("path",))),
    ("write_file", "Create or overwrite a file", _o({"path": _s(), "content": _s()}, ("path", "content"))),
    ("edit_file", "Replace exact text in a file", _o({"path": _s(), "edits": _a(_o(
        {"old_text": _s(), "new_text": _s(), "replace_all": _b()}, ("old_text", "new_text")), minItems=1),
        "dry_run": _b()}, ("path", "edits"))),
    ("list_directory", "List a directory", _o({"path": _s(), "recursive": _b(), "ignore": _a(_s())}, ("path",))),
    ("glob", "Find files by pattern", _o({"pattern": _s(), "path": _null(_s())}, ("pattern",))),
    ("grep", "Search file contents", _o({"pattern": _s(), "path": _s(), "glob": _s(),
                                         "output_mode": _e("content", "files_with_matches", "count"),
                                         "case_insensitive": _b(), "context_lines": _i(minimum=0, maximum=20)},
                                        ("pattern",))),
    ("bash", "Run a shell command", _o({"command": _s(), "timeout_ms": _i(maximum=600000), "cwd": _null(_s()),
                                        "run_in_background": _b()}, ("command",))),
    ("git_status", "Show the working tree status", _o({"repo_path": _s()}, ("repo_path",))),
    ("git_diff", "Diff the working tree or two refs", _o({"repo_path": _s(), "target": _s(), "context_lines": _i(),
                                                          "paths": _a(_s())}, ("repo_path",))),
    ("git_commit", "Record staged changes", _o({"repo_path": _s(), "message": _s(), "author": _PERSON,
                                                "amend": _b()}, ("repo_path", "message"))),
    ("git_log", "Show commit logs", _o({"repo_path": _s(), "max_count": _i(minimum=1), "since": _null(_s()),
                                        "format": _e("oneline", "short", "full")}, ("repo_path",))),
    ("create_pull_request", "Open a pull request on GitHub", _o({
        "owner": _s(), "repo": _s(), "title": _s(), "body": _s(), "head": _s(), "base": _s(), "draft": _b(),
        "reviewers": _a(_s()), "labels": _a(_s())}, ("owner", "repo", "title", "head", "base"))),
    ("search_issues", "Search GitHub issues and pull requests", _o({
        "query": _s(), "sort": _e("comments", "reactions", "created", "updated"), "order": _e("asc", "desc"),
        "per_page": _i(minimum=1, maximum=100), "page": _i(minimum=1)}, ("query",))),
    ("add_issue_comment", "Comment on an issue", _o({"owner": _s(), "repo": _s(), "issue_number": _i(minimum=1),
                                                     "body": _s()}, ("owner", "repo", "issue_number", "body"))),
    ("web_search", "Search the web", _o({"query": _s(), "num_results": _i(minimum=1, maximum=20),
                                         "recency": _e("day", "week", "month", "year", "any"),
                                         "domains": _o({"include": _a(_s()), "exclude": _a(_s())})}, ("query",))),
    ("fetch_url", "Fetch a URL and return its content as markdown", _o({
        "url": _s(format="uri"), "method": _e("GET", "POST", "PUT", "DELETE", "PATCH"),
        "headers": {"type": "object", "additionalProperties": _s()}, "body": _null(_s()),
        "max_length": _i(minimum=1)}, ("url",))),
    ("browser_navigate", "Navigate the browser", _o({"url": _s(), "wait_until": _e("load", "domcontentloaded",
                                                                                     "networkidle")}, ("url",))),
    ("browser_click", "Click an element", _o({"element": _s("human-readable description"), "ref": _s(),
                                              "button": _e("left", "right", "middle"),
                                              "modifiers": _a(_e("Alt", "Control", "Meta", "Shift"))},
                                             ("element", "ref"))),
    ("browser_fill_form", "Fill form fields", _o({"fields": _a(_o({
        "ref": _s(), "type": _e("textbox", "checkbox", "radio", "combobox", "slider"),
        "value": {"anyOf": [_s(), _b(), {"type": "number"}]}}, ("ref", "type", "value")), minItems=1)},
        ("fields",))),
    ("send_slack_message", "Post a message to a Slack channel", _o({
        "channel": _s(), "text": _s(), "thread_ts": _null(_s()),
        "blocks": _a(_o({"type": _e("section", "divider", "header", "context"),
                         "text": _o({"type": _e("mrkdwn", "plain_text"), "text": _s()}, ("type", "text"))},
                        ("type",)))}, ("channel", "text"))),
    ("send_email", "Send an email", _o({"to": _a(_PERSON, minItems=1), "cc": _a(_PERSON), "subject": _s(),
                                        "body": _s(), "format": _e("text", "html"),
                                        "attachments": _a(_o({"filename": _s(), "url": _s()}, ("filename", "url")))},
                                       ("to", "subject", "body"))),
    ("create_calendar_event", "Create a calendar event", _o({
        "title": _s(), "when": {"$ref": "#/$defs/range"}, "attendees": _a({"$ref": "#/$defs/person"}),
        "location": _null(_s()), "recurrence": _o({"freq": _e("DAILY", "WEEKLY", "MONTHLY", "YEARLY"),
                                                   "interval": _i(minimum=1), "count": _i(minimum=1)}, ("freq",)),
        "reminders": _a(_i("minutes before", minimum=0))}, ("title", "when"),
        # "$id": its "#/$defs/..." refs resolve inside the arguments of a forced call, where
        # call_schema nests these parameters (without it they would point at the call's root)
        **{"$id": "https://agentserve.invalid/tools/create_calendar_event",
           "$defs": {"range": _RANGE, "person": _PERSON}})),
    ("list_calendar_events", "List events in a time range", _o({"range": _RANGE, "calendar_id": _s(),
                                                               "max_results": _i(minimum=1)}, ("range",))),
    ("query_database", "Run a read-only SQL query", _o({"sql": _s(), "params": _a({"type": ["string", "number",
                                                                                            "boolean", "null"]}),
                                                        "database": _e("analytics", "orders", "users"),
                                                        "row_limit": _i(minimum=1, maximum=10000)}, ("sql",))),
    ("describe_table", "Describe a table's columns", _o({"table": _s(), "schema": _s()}, ("table",))),
    ("search_records", "Search CRM records", _o({"object": _e("contact", "company", "deal", "ticket"),
                                                 "filters": _a(_FILTER), "sort": _o({"field": _s(), "direction":
                                                                                     _e("asc", "desc")}, ("field",)),
                                                 "limit": _i(minimum=1, maximum=100)}, ("object",))),
    ("create_ticket", "Create an issue-tracker ticket", _o({
        "project": _s(), "summary": _s(), "description": _s(), "issue_type": _e("Bug", "Task", "Story", "Epic"),
        "priority": _e("Highest", "High", "Medium", "Low", "Lowest"), "assignee": _null(_s()),
        "labels": _a(_s()), "custom_fields": {"type": "object", "additionalProperties": True}},
        ("project", "summary", "issue_type"))),
    ("transition_ticket", "Move a ticket to another status", _o({"ticket": _s(), "status": _e(
        "To Do", "In Progress", "In Review", "Done"), "comment": _s()}, ("ticket", "status"))),
    ("kubectl_get", "Get Kubernetes resources", _o({"resource": _e("pods", "deployments", "services", "nodes",
                                                                    "configmaps", "jobs"),
                                                    "namespace": _s(), "name": _s(), "label_selector": _s(),
                                                    "output": _e("json", "yaml", "wide")}, ("resource",))),
    ("kubectl_apply_deployment", "Apply a Deployment", _o({
        "name": _s(), "namespace": _s(), "replicas": _i(minimum=0),
        "containers": _a(_CONTAINER, minItems=1), "strategy": _o({"type": _e("RollingUpdate", "Recreate"),
                                                                  "max_surge": {"anyOf": [_i(), _s()]}}, ("type",))},
        ("name", "containers"))),
    ("get_logs", "Fetch service logs", _o({"service": _s(), "level": _e("debug", "info", "warn", "error"),
                                           "since_minutes": _i(minimum=1), "query": _s(), "limit": _i()},
                                          ("service",))),
    ("create_alert", "Create a monitoring alert", _o({
        "name": _s(), "metric": _s(), "condition": _o({"op": _e(">", ">=", "<", "<="), "threshold": {"type": "number"},
                                                       "for_minutes": _i(minimum=1)}, ("op", "threshold")),
        "severity": _e("critical", "warning", "info"), "notify": _a({"oneOf": [
            _o({"kind": {"const": "email"}, "address": _s()}, ("kind", "address")),
            _o({"kind": {"const": "slack"}, "channel": _s()}, ("kind", "channel")),
            _o({"kind": {"const": "pagerduty"}, "service_key": _s()}, ("kind", "service_key"))]})},
        ("name", "metric", "condition"))),
    ("get_weather", "Current weather and forecast", _o({"location": _s(), "unit": _e("celsius", "fahrenheit"),
                                                        "days": _i(minimum=1, maximum=14)}, ("location",))),
    ("convert_currency", "Convert between currencies", _o({"amount": {"type": "number", "minimum": 0},
                                                           "from": _s(pattern="^[A-Z]{3}$"),
                                                           "to": _s(pattern="^[A-Z]{3}$")}, ("amount", "from", "to"))),
    ("create_invoice", "Create a customer invoice", _o({
        "customer": _o({"id": _s(), "name": _s(), "address": _o({"line1": _s(), "city": _s(), "country": _s(),
                                                                  "postal_code": _s()}, ("line1", "country"))},
                       ("id",)),
        "items": _a(_o({"description": _s(), "quantity": _i(minimum=1), "unit_price": {"type": "number"},
                        "tax_rate": _null({"type": "number"})}, ("description", "quantity", "unit_price")),
                    minItems=1),
        "currency": _e("USD", "EUR", "GBP", "JPY"), "due_date": _s(format="date")}, ("customer", "items"))),
    ("run_tests", "Run the project's tests", _o({"paths": _a(_s()), "keyword": _s(), "fail_fast": _b(),
                                                 "framework": _e("pytest", "jest", "go", "cargo")})),
    ("install_package", "Install a package", _o({"manager": _e("pip", "npm", "cargo", "apt"), "name": _s(),
                                                 "version": _null(_s()), "dev": _b()}, ("manager", "name"))),
    ("memory_store", "Remember a fact for later turns", _o({"key": _s(), "value": _s(),
                                                            "tags": _a(_s(), maxItems=10),
                                                            "ttl_days": _null(_i(minimum=1))}, ("key", "value"))),
    ("delegate_task", "Hand a sub-task to a sub-agent", _o({
        "description": _s(), "prompt": _s(), "agent": _e("general", "researcher", "coder", "reviewer"),
        "tools": _a(_s()), "budget": _o({"max_turns": _i(minimum=1), "max_tokens": _i(minimum=1)})},
        ("description", "prompt"))),
    ("update_plan", "Update the task plan", _o({"explanation": _s(), "plan": _a(_o({
        "step": _s(), "status": _e("pending", "in_progress", "completed")}, ("step", "status")))}, ("plan",))),
]
assert len(_TOOLS) == 40 and len({name for name, _, _ in _TOOLS}) == 40


def agent_tools(salt: str = "") -> list[dict[str, Any]]:
    """The forty tools. A salt goes into every function name and parameters title (as pydantic
    writes one), so each salt is forty schemas and a forced-call grammar never seen before."""
    return [{"type": "function", "function": {"name": f"{name}{salt}", "description": desc,
                                              "parameters": {"title": f"{name}{salt}", **params}}}
            for name, desc, params in _TOOLS]
