"""logdx as a tool for AI agents: `logdx mcp`, a Model Context Protocol server (the official `mcp` SDK).

`tools.py` holds what the tools do (plain methods, typed answers), `server.py` registers them and runs a
transport (stdio or streamable HTTP), `cli.py` is the `logdx mcp` command. An agent that would re-read
100,000 lines gets the root line, the culprit and the evidence from one call.
"""
