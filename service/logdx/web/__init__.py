"""The job page: a self-contained web view of one job's diagnosis (`GET /jobs/{id}`, `diagnose --html`).

`view` builds what the page shows from a diagnosed session (bounded, from the compressed state);
`store` keeps it beside the report; `render` turns it into HTML with the assets under `static/`."""
