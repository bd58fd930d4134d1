"""`raytf spot-watch`: AWS's Spot interruption notice, read through IMDSv2 from a local stand-in for the
metadata service, becomes one drain of this node with the notice's deadline."""
import datetime
import http.server
import subprocess
import sys
import threading

import pytest

from raytf import spot_watch

pytestmark = pytest.mark.timeout(30)


class FakeMetadata(http.server.BaseHTTPRequestHandler):
    """IMDSv2: PUT /latest/api/token, then GET spot/instance-action with the token; 404 until a notice."""

    notice: str | None = None
    polls = 0

    def do_PUT(self):
        if self.path != "/latest/api/token" or "X-aws-ec2-metadata-token-ttl-seconds" not in self.headers:
            return self.send_error(400)
        self._reply(200, b"secret-token")

    def do_GET(self):
        if self.headers.get("X-aws-ec2-metadata-token") != "secret-token":
            return self.send_error(401)
        FakeMetadata.polls += 1
        if self.path != "/latest/meta-data/spot/instance-action" or FakeMetadata.notice is None:
            return self.send_error(404)
        self._reply(200, FakeMetadata.notice.encode())

    def _reply(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def imds():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeMetadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeMetadata.notice, FakeMetadata.polls = None, 0
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


NOW = datetime.datetime(2026, 12, 3, 22, 36, 40, tzinfo=datetime.timezone.utc).timestamp()


def test_the_notice_time_gives_the_seconds_left():
    assert spot_watch.seconds_left('{"action": "terminate", "time": "2026-12-03T22:38:40Z"}', NOW) == 120
    assert spot_watch.seconds_left('{"action": "stop", "time": "2026-12-03T22:30:00Z"}', NOW) == 1  # already due
    assert spot_watch.seconds_left("", NOW) is None and spot_watch.seconds_left('{"action": "stop"}', NOW) is None


def test_no_notice_no_drain_then_one_drain_with_the_deadline(imds):
    drained = []

    def sleep(_):
        if FakeMetadata.polls == 3:  # the third look finds AWS's notice
            FakeMetadata.notice = '{"action": "terminate", "time": "2026-12-03T22:38:40Z"}'

    left = spot_watch.watch(imds, interval_s=0, drain=drained.append, clock=lambda: NOW, sleep=sleep,
                            log=lambda line: None)
    assert left == 120 and drained == [120] and FakeMetadata.polls == 4


def test_a_drain_that_fails_is_tried_again_at_the_next_poll(imds):
    FakeMetadata.notice = '{"action": "terminate", "time": "2026-12-03T22:38:40Z"}'
    tries, lines = [], []

    def drain(left):
        tries.append(left)
        if len(tries) == 1:  # the GCS did not answer the first time
            raise subprocess.CalledProcessError(1, ["ray", "drain-node"])

    left = spot_watch.watch(imds, interval_s=0, drain=drain, clock=lambda: NOW, sleep=lambda _: None,
                            log=lines.append)
    assert left == 120 and tries == [120, 120] and any("the drain failed" in line for line in lines)


def test_a_metadata_service_that_does_not_answer_is_polled_again():
    lines, looks = [], []
    spot_watch.watch("http://127.0.0.1:9", interval_s=0, drain=pytest.fail, log=lines.append,
                     sleep=looks.append, until=lambda: len(looks) >= 2)
    assert len(lines) == 2 and "instance metadata not answering" in lines[0]


def test_the_console_script_has_the_command():
    out = subprocess.run([sys.executable, "-m", "raytf.cli", "spot-watch", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and "Spot node" in out.stdout
