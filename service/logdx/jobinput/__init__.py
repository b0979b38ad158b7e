"""One job's inputs, as every face reads them: files, folders and streams with what is known of them (a file's
host or rank from the launcher's per-host file naming, a stream's source), turned into lines in time order
with their hosts and ranks, fed to a session (`logdx.pipeline`).

- `files`: which files a job is, and what their names and first lines say (hosts only from trusted names);
- `merge`: their lines in time order, each normalised once, fed as records (`Session.feed_records`);
- `read`: `open_job` (one path is one log, several or a folder one job's files), `diagnose_job`;
- `keep`: storing a diagnosis (report, nodes, costs).

The faces (`diagnose`, `logdx mcp`, the evaluation) call these; nothing here knows a face.
"""

from logdx.jobinput.files import LogFile, collect, name_of
from logdx.jobinput.merge import LineMap, merged_lines
from logdx.jobinput.read import Diagnosed, JobFiles, JobInput, OneInput, diagnose_files, diagnose_job, open_job

__all__ = ["Diagnosed", "JobFiles", "JobInput", "LineMap", "LogFile", "OneInput", "collect", "diagnose_files",
           "diagnose_job", "merged_lines", "name_of", "open_job"]
