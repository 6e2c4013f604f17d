//! A smaller model answering instead: when a request's model cannot run (every serving pool's
//! breaker is open, no pool can take work, or it does not fit: the policy refused it, the host's
//! memory reserve, no pool could ever give it enough) and the client allows it, the request is
//! placed again as a request for the model's `fallback_model`, rebuilt from what the client
//! sent by the protocol that decoded it (the fallback's own inputs, tokenizer and template).
//! Placing is two-phase so that the lifecycle never calls the protocol: a refusal the fallback
//! may meet comes back as a [`Fallback`], which the protocol hands the rebuilt request.
//! Only one hop: the fallback's own fallback is not followed. Without the client's leave the
//! model is never swapped, since another model changes the answer; a deadline, bad input, an
//! unknown model or a deferral past the bound is never a reason to.
//!
//! A substituted request is counted once in the request metrics, under the model that
//! answered ([`Answering`]), and once in `vramguard_substitutions_total`.

use std::future::Future;
use std::sync::OnceLock;

use crate::pool::activity::Progress;
use crate::serve::metrics::{SubstitutionLabels, SubstitutionReason};
use crate::serve::service::Service;

use super::{Refused, Request, RequestError, Served, place};

/// The model a request is answered by, for counting it under that one: the model asked for,
/// until its fallback takes the request.
#[derive(Debug)]
pub struct Answering {
    requested: String,
    substitute: OnceLock<String>,
}

impl Answering {
    /// A request for `model`, not substituted (yet).
    pub fn new(model: &str) -> Answering {
        Answering {
            requested: model.to_string(),
            substitute: OnceLock::new(),
        }
    }

    /// The model answering now.
    pub fn model(&self) -> &str {
        self.substitute.get().unwrap_or(&self.requested)
    }
}

/// A request its model's fallback took: who stood in for whom and why.
#[derive(Debug)]
pub struct Substitution {
    /// The model asked for.
    pub requested: String,
    /// The model that answers.
    pub model: String,
    /// Why the model asked for could not.
    pub reason: SubstitutionReason,
}

/// A request placed, or refused where its model's fallback may answer instead.
#[derive(Debug)]
pub enum Placement {
    /// It ran on its model.
    Served(Served),
    /// It was refused for a [`reason_of`] the fallback may not meet, its model has a
    /// `fallback_model` and the client allows a substitute: the protocol rebuilds the request
    /// for [`Fallback::model`] from what the client sent and hands it to [`Fallback::place`]
    /// (or says why it cannot: [`Fallback::cannot`]).
    Fallback(Fallback),
}

/// A refused request its model's fallback may take: the second phase of placing it.
#[derive(Debug)]
pub struct Fallback {
    /// The model's own refusal, what the client gets if the fallback cannot answer either.
    refused: Refused,
    requested: String,
    fallback: String,
    reason: SubstitutionReason,
    /// The client's place in the waiting and running counts, which the rebuilt request keeps.
    progress: Progress,
}

/// Why a refusal lets a substitute answer, if it does: refusals before anything ran that
/// another (smaller) model may not meet. Everything else is the client's to fix, a matter of
/// time (deadline, deferral past the bound, a full queue) or a run that failed.
pub(super) fn reason_of(error: &RequestError) -> Option<SubstitutionReason> {
    match error {
        RequestError::BreakerOpen { .. } => Some(SubstitutionReason::breaker_open),
        RequestError::NoPool { .. } | RequestError::Unavailable { .. } => Some(SubstitutionReason::unavailable),
        RequestError::Refused { .. } | RequestError::HostMemory { .. } | RequestError::NeverFits(_) => {
            Some(SubstitutionReason::no_fit)
        }
        _ => None,
    }
}

/// [`place`]; or, when the request is refused for a [`reason_of`], its model has a
/// `fallback_model` and the request allows a substitute, the [`Fallback`] that may answer
/// instead.
pub async fn place_or_fallback(service: &Service, request: Request) -> Result<Placement, Refused> {
    place_or_fallback_with(service, request, |request| place(service, request)).await
}

/// [`place_or_fallback`], placing the request with `place` (a batcher's, `serve::batching`).
pub async fn place_or_fallback_with<'a, F, P>(
    service: &'a Service,
    request: Request,
    place: P,
) -> Result<Placement, Refused>
where
    P: FnOnce(Request) -> F,
    F: Future<Output = Result<Served, Refused>> + 'a,
{
    let allowed = request.allow_substitute;
    let requested = request.model.clone();
    // The client's request is still waiting while its fallback is asked: the same place in
    // the waiting and running counts.
    let progress = request.progress.clone();
    let refused = match place(request).await {
        Ok(served) => return Ok(Placement::Served(served)),
        Err(refused) => refused,
    };
    let Some(reason) = reason_of(&refused.error) else {
        return Err(refused);
    };
    let Some(fallback) = service.model(&requested).and_then(|e| e.config.fallback_model.clone()) else {
        return Err(refused);
    };
    if !allowed {
        tracing::debug!(model = %requested, %fallback, "a substitute could answer, but the request does not allow one");
        return Err(refused);
    }
    Ok(Placement::Fallback(Fallback {
        refused,
        requested,
        fallback,
        reason,
        progress,
    }))
}

impl Fallback {
    /// The model that may answer instead, for which the request is rebuilt.
    pub fn model(&self) -> &str {
        &self.fallback
    }

    /// The client's answer when the request could not be rebuilt for the fallback (`why`):
    /// the first refusal, saying so.
    pub fn cannot(self, why: &str) -> Refused {
        let fallback = &self.fallback;
        let note = format!("its substitute `{fallback}` could not take the request: {why}");
        noted(self.refused, note)
    }

    /// Place `substitute`, the request made again for the fallback from what the client sent,
    /// as the request `answering` counts. When the fallback cannot take it either, the client
    /// gets the first refusal, saying why.
    pub async fn place(
        self,
        service: &Service,
        answering: &Answering,
        mut substitute: Request,
    ) -> Result<(Served, Substitution), Refused> {
        let Fallback {
            refused,
            requested,
            fallback,
            reason,
            progress,
        } = self;
        substitute.progress = progress;
        // One hop: the fallback's own fallback is not asked.
        substitute.allow_substitute = false;
        match place(service, substitute).await {
            Ok(served) => {
                tracing::info!(model = %requested, %fallback, ?reason, "the fallback model answers instead");
                service
                    .metrics
                    .failover
                    .substitutions
                    .get_or_create(&SubstitutionLabels {
                        model: requested.clone(),
                        fallback_model: fallback.clone(),
                        reason,
                    })
                    .inc();
                let _ = answering.substitute.set(fallback.clone());
                let substitution = Substitution {
                    requested,
                    model: fallback,
                    reason,
                };
                Ok((served, substitution))
            }
            Err(also) => Err(noted(
                refused,
                format!("its substitute `{fallback}` could not take it either: {}", also.error),
            )),
        }
    }
}

/// `refused`, its reason ending with `note`.
fn noted(mut refused: Refused, note: String) -> Refused {
    match &mut refused.error {
        RequestError::BreakerOpen { why: text, .. }
        | RequestError::NoPool { reasons: text, .. }
        | RequestError::Unavailable { reason: text, .. }
        | RequestError::Refused { reason: text, .. }
        | RequestError::HostMemory { reason: text, .. } => {
            text.push_str("; ");
            text.push_str(&note);
        }
        RequestError::NeverFits(never) => never.substitute = Some(note),
        _ => {}
    }
    refused
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::serve::lifecycle::DeadlineMiss;

    #[test]
    fn only_refusals_another_model_may_not_meet_allow_a_substitute() {
        let breaker = RequestError::BreakerOpen {
            pool: "gpu".into(),
            why: "a driver failure".into(),
            retry_after: Duration::from_secs(1),
        };
        assert_eq!(reason_of(&breaker), Some(SubstitutionReason::breaker_open));
        let policy = RequestError::Refused {
            reason: "too big".into(),
            retry_after: Duration::from_secs(1),
        };
        assert_eq!(reason_of(&policy), Some(SubstitutionReason::no_fit));
        let none = RequestError::NoPool {
            model: "m".into(),
            reasons: "gpu: not ready".into(),
        };
        assert_eq!(reason_of(&none), Some(SubstitutionReason::unavailable));
        let not_reasons = [
            RequestError::BadInput("x".into()),
            RequestError::Deadline(DeadlineMiss::OnArrival),
            RequestError::UnknownModel {
                model: "m".into(),
                known: "a".into(),
            },
            RequestError::DeferredTooLong {
                pool: "gpu".into(),
                deferred: Duration::from_secs(1),
                bound: Duration::from_secs(1),
                retry_after: Duration::from_secs(1),
            },
            RequestError::QueueFull {
                pool: "gpu".into(),
                capacity: 1,
                retry_after: Duration::from_secs(1),
            },
        ];
        for error in not_reasons {
            assert_eq!(reason_of(&error), None, "{error:?}");
        }
    }

    #[test]
    fn a_refusal_says_why_the_substitute_did_not_answer() {
        let refused = Refused {
            pool: None,
            error: RequestError::BreakerOpen {
                pool: "gpu".into(),
                why: "a driver failure".into(),
                retry_after: Duration::from_secs(1),
            },
        };
        let noted = noted(refused, "its substitute `small` could not take the request: no".into());
        assert_eq!(
            noted.error.to_string(),
            "pool `gpu` is not taking work: its circuit breaker is open after a driver failure; \
             its substitute `small` could not take the request: no"
        );
    }
}
