"""Settings precedence: flags > environment > TOML file > defaults; bad settings are named."""

import pytest

from autobyted.errors import ConfigError
from autobyted.settings import load_settings


def write(tmp_path, text):
    path = tmp_path / "autobyted.toml"
    path.write_text(text)
    return str(path)


def test_precedence(tmp_path):
    config = write(
        tmp_path,
        '[autobyted]\nlisten = "127.0.0.1:1111"\ndb = "sqlite:///file.db"\n'
        'log-level = "DEBUG"\nretention_raw_samples = 5\n',
    )
    env = {"AUTOBYTED_LISTEN": "127.0.0.1:2222", "AUTOBYTED_DB": "sqlite:///env.db"}
    settings = load_settings({"listen": "127.0.0.1:3333", "db": None}, config, env)
    assert settings.listen == "127.0.0.1:3333"  # flag
    assert settings.db == "sqlite:///env.db"  # environment
    assert settings.log_level == "DEBUG"  # file
    assert settings.retention_raw_samples == 5  # file
    assert settings.token is None  # default
    assert load_settings({}, None, {}).listen == "127.0.0.1:7077"


@pytest.mark.parametrize(
    "text, message",
    [
        ('listen = "nonsense"', "HOST:PORT"),
        ('colour = "blue"', "unknown setting 'colour'"),
        ('listen = "0.0.0.0:7077"', "without a token"),
        ("retention_raw_samples = -4", "must be positive"),
        ("log_level = 'LOUD'", "log level"),
        ("listen = ", "not valid TOML"),
        ('db = "sqlite://"', "in-memory"),
        ('db = "sqlite:///:memory:"', "in-memory"),
    ],
)
def test_bad_settings_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_settings({}, write(tmp_path, text), {})


def test_beyond_loopback_needs_a_token_and_tls_unless_insecure():
    """The token never travels in clear text off loopback by accident."""
    with pytest.raises(ConfigError, match="without TLS"):
        load_settings({"listen": "0.0.0.0:7077"}, None, {"AUTOBYTE_TOKEN": "x"})
    with_tls = load_settings(
        {"listen": "0.0.0.0:7077", "tls_cert": "c.pem", "tls_key": "k.pem"},
        None,
        {"AUTOBYTE_TOKEN": "x"},
    )
    assert with_tls.token == "x" and with_tls.listens_beyond_loopback
    insecure = load_settings(
        {"listen": "0.0.0.0:7077", "insecure": True}, None, {"AUTOBYTE_TOKEN": "x"}
    )
    assert insecure.insecure and insecure.tls_cert is None
    assert load_settings(
        {"listen": "10.1.2.3:7077"}, None, {"AUTOBYTE_TOKEN": "x", "AUTOBYTED_INSECURE": "1"}
    ).insecure
    with pytest.raises(
        ConfigError, match="without a token"
    ):  # --insecure waives TLS, not the token
        load_settings({"listen": "0.0.0.0:7077", "insecure": True}, None, {})
    assert not load_settings({"listen": "[::1]:7077"}, None, {}).listens_beyond_loopback


def test_metrics_endpoint_binds_loopback_by_default(tmp_path):
    assert load_settings({"metrics_listen": "9100"}, None, {}).metrics_listen == "127.0.0.1:9100"
    assert (
        load_settings({}, write(tmp_path, "metrics_listen = 9101"), {}).metrics_listen
        == "127.0.0.1:9101"
    )
    assert (
        load_settings({"metrics_listen": "0.0.0.0:9100"}, None, {}).metrics_listen == "0.0.0.0:9100"
    )


def test_operability_settings_from_every_source(tmp_path):
    assert load_settings({}, None, {}).max_concurrent_rpcs == 2048
    assert (
        load_settings({}, write(tmp_path, "max-concurrent-rpcs = 64"), {}).max_concurrent_rpcs == 64
    )
    env = {"AUTOBYTED_MAX_CONCURRENT_RPCS": "32", "AUTOBYTED_SQLITE_SYNCHRONOUS": "full"}
    from_env = load_settings({}, None, env)
    assert (from_env.max_concurrent_rpcs, from_env.sqlite_synchronous) == (32, "full")
    assert load_settings({"max_concurrent_rpcs": 8}, None, env).max_concurrent_rpcs == 8
    with pytest.raises(ConfigError, match="must be positive"):
        load_settings({"max_concurrent_rpcs": 0}, None, {})
    with pytest.raises(ConfigError, match="normal or full"):
        load_settings({"sqlite_synchronous": "off"}, None, {})
    with pytest.raises(ConfigError, match="true or false"):
        load_settings({}, None, {"AUTOBYTED_INSECURE": "maybe"})


@pytest.mark.parametrize(
    "url, shown",
    [
        (
            "postgresql://alice:hunter2@db.example:5432/autobyte",
            "postgresql://alice:***@db.example:5432/autobyte",
        ),
        (
            "postgresql+psycopg://alice:hunter2@db:notaport/x",
            "postgresql+psycopg://alice:***@db:notaport/x",
        ),
        ("sqlite:///autobyte.db", "sqlite:///autobyte.db"),
        ("mysql://bob@db/x", "mysql://bob@db/x"),
    ],
)
def test_database_passwords_are_redacted(url, shown):
    from autobyted.settings import redact, redact_url, secrets_of

    assert redact_url(url) == shown
    if "hunter2" in url:  # the password also goes wherever a driver's message quotes it
        assert "hunter2" not in redact(
            f"cannot use {url}: hunter2 refused", secrets_of(url, "tok3n")
        )
    assert redact("token tok3n", secrets_of(url, "tok3n")) == "token ***"


def test_missing_config_file():
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings({}, "/nonexistent/autobyted.toml", {})
