"""A run's start-up prints rlcore's phases, not library notices that ask nothing of the user: Ray's
"Token authentication is enabled ..." is dropped at its logger (Ray's other warnings still show)."""

import logging

from ray._private.authentication import authentication_token_setup as ray_token

from rlcore.trainer.builder import RAY_TOKEN_LOGGER, quiet_token_notice


def test_rays_token_notice_is_dropped_and_its_other_warnings_are_not(caplog, monkeypatch):
    assert ray_token.logger.name == RAY_TOKEN_LOGGER  # the logger the filter sits on is the one Ray logs to
    monkeypatch.setattr(ray_token.logger, "filters", [])  # as in a fresh process (an earlier test may have run Ray)
    with caplog.at_level(logging.WARNING, logger=RAY_TOKEN_LOGGER):
        ray_token._warn_token_auth_enabled()  # Ray's own call, as ray.init of a local instance makes it
        assert "Token authentication is enabled" in caplog.text  # the filter is what removes it
        caplog.clear()
        quiet_token_notice()
        quiet_token_notice()  # twice: one filter
        ray_token._warn_token_auth_enabled()
        ray_token._warn_token_auth_disabled()
    assert "Token authentication is enabled" not in caplog.text
    assert "Token authentication is disabled for this Ray cluster" in caplog.text
    assert len(logging.getLogger(RAY_TOKEN_LOGGER).filters) == 1
