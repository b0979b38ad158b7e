"""Who is calling and what they may do (tokens, roles, tenants, node credentials): one answer for every
face that takes callers (the HTTP service, the MCP server). Nothing here imports a web framework.
"""
