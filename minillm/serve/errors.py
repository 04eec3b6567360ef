"""OpenAI's error body, and the exception that carries one from anywhere in a handler to the client.

Every failure a client can see has the same shape, whatever went wrong:

    HTTP 400  {"error": {"message": "temperature must be a number >= 0, got -1.0",
                         "type": "invalid_request_error", "param": "temperature", "code": null}}

The ``openai`` client turns the status into its exception class (400 BadRequestError, 404
NotFoundError, 503 InternalServerError, ...) and shows ``message``. Status codes used here:

    400  a bad value, a wrong type, an unknown field, malformed JSON, a prompt that does not fit
         (OpenAI and vLLM answer wrong types with 400 too, not FastAPI's default 422)
    404  an unknown model or route
    503  the waiting queue is full, or the server is shutting down
    500  a failure inside the server
"""
from __future__ import annotations

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class APIError(Exception):
    """Raised anywhere while handling a request; the app turns it into a JSON error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return SERVER_ERROR if self.status >= 500 else INVALID_REQUEST

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
