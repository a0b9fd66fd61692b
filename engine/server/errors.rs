//! `ApiError`: OpenAI-style error bodies, and how engine errors map to HTTP
//! status codes (overload 429 + Retry-After, context and bad fields 400,
//! unknown model 404, engine gone 503).

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::error::SpecdError;

/// An OpenAI-style error response.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// 404 for a model this server does not serve (`served`).
    pub fn model_not_found(asked: &str, served: &str) -> Self {
        Self {
            code: Some("model_not_found"),
            param: Some("model".into()),
            ..Self::status(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("model `{asked}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// This error as prompt `i` of a batch request's: the message says
    /// which prompt, and a `prompt` param becomes `prompt[i]`.
    pub fn for_prompt(mut self, i: usize) -> Self {
        let name = format!("prompt[{i}]");
        self.message = format!("{name}: {}", self.message);
        if self.param.as_deref() == Some("prompt") {
            self.param = Some(name);
        }
        self
    }

    /// Whether this error is about the prompt itself (its tokens, or its
    /// length against the context), not a field a batch's prompts share.
    pub fn is_about_the_prompt(&self) -> bool {
        self.param.as_deref() == Some("prompt") || self.code == Some("context_length_exceeded")
    }

    pub fn bad_field(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
            retry_after: None,
        }
    }

    pub(super) fn status(
        status: StatusCode,
        kind: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status);
        if let Some(s) = self.retry_after {
            r.insert_header(("Retry-After", s.to_string()));
        }
        r.json(json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }))
    }
}

impl From<SpecdError> for ApiError {
    fn from(e: SpecdError) -> Self {
        match &e {
            SpecdError::Overloaded(_) => Self {
                retry_after: Some(1),
                code: Some("overloaded"),
                ..Self::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    e.to_string(),
                )
            },
            SpecdError::ContextOverflow { .. } => Self {
                code: Some("context_length_exceeded"),
                ..Self::bad_field("max_tokens", e.to_string())
            },
            SpecdError::InvalidField { field, msg } => Self::bad_field(field, msg.clone()),
            SpecdError::InvalidRequest(m) => Self {
                param: None,
                ..Self::bad_field("", m.clone())
            },
            SpecdError::EngineStopped => Self::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                e.to_string(),
            ),
            _ => Self::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}
