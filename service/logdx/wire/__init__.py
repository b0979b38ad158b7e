"""The wire models: what crosses a face's boundary (requests, answers, errors), as pydantic schemas.

Neutral ground for both faces: the HTTP service (`logdx.api`) and the MCP server (`logdx.agent`) import
these, never each other; the job runtime (`logdx.jobs`) may raise `errors.ApiError`.
"""
