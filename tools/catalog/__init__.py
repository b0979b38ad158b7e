"""Build-time tooling for the error catalog (`make catalog`): reads the frameworks' release files,
extracts their error messages, labels them with logdx's taxonomy, and writes
`service/logdx/kb/catalog.jsonl.gz`. Never imported at run time."""
