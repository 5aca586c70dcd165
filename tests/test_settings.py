"""Settings precedence: flags > environment > TOML file > defaults; bad settings are named."""

import pytest

from autobyted.errors import ConfigError
from autobyted.settings import load_settings


def write(tmp_path, text):
    path = tmp_path / "autobyted.toml"
    path.write_text(text)
    return str(path)


def test_precedence(tmp_path):
    config = write(tmp_path, '[autobyted]\nlisten = "127.0.0.1:1111"\ndb = "sqlite:///file.db"\n'
                             'log-level = "DEBUG"\nretention_raw_samples = 5\n')
    env = {"AUTOBYTED_LISTEN": "127.0.0.1:2222", "AUTOBYTED_DB": "sqlite:///env.db"}
    settings = load_settings({"listen": "127.0.0.1:3333", "db": None}, config, env)
    assert settings.listen == "127.0.0.1:3333"      # flag
    assert settings.db == "sqlite:///env.db"         # environment
    assert settings.log_level == "DEBUG"             # file
    assert settings.retention_raw_samples == 5       # file
    assert settings.token is None                    # default
    assert load_settings({}, None, {}).listen == "127.0.0.1:7077"


@pytest.mark.parametrize("text, message", [
    ('listen = "nonsense"', "HOST:PORT"),
    ('colour = "blue"', "unknown setting 'colour'"),
    ('listen = "0.0.0.0:7077"', "without a token"),
    ("retention_raw_samples = -4", "must be positive"),
    ("log_level = 'LOUD'", "log level"),
    ("listen = ", "not valid TOML"),
    ('db = "sqlite://"', "in-memory"),
    ('db = "sqlite:///:memory:"', "in-memory"),
])
def test_bad_settings_are_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_settings({}, write(tmp_path, text), {})


def test_token_from_environment_allows_any_address():
    settings = load_settings({"listen": "0.0.0.0:7077"}, None, {"AUTOBYTE_TOKEN": "x"})
    assert settings.token == "x"


def test_missing_config_file():
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings({}, "/nonexistent/autobyted.toml", {})
