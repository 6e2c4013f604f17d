//! A tensor graph's request (the Open Inference Protocol's `infer`, which Triton's clients
//! send): the one run of the tensors its protocol decoded, placed through the model's batcher
//! when it batches, or, when the model is refused for a reason its `fallback_model` may not
//! meet and the client allows a substitute, on that model with the request decoded again for
//! its signature. A tensor graph has no work of its own beyond its signature, which the
//! protocol checked as it decoded: its job is the [`Request`] itself.
//!
//! The request is counted once, when its answer is made ([`Ran::finish`]): an answer that
//! cannot be made (over `server.max_response_bytes`) is counted with the error its client gets.

use crate::serve::batching::Batchers;
use crate::serve::lifecycle::{Counted, Placement, Refused, Request, RequestError, Served, Substitution};
use crate::serve::ran::RanOn;
use crate::serve::service::Service;

/// A request that ran: what its run gave, who answered, and where.
pub struct Ran<'a, D> {
    counted: Counted<'a>,
    /// What its run gave, and the decision that placed it.
    pub served: Served,
    /// Set when the model's fallback answered instead, with what the protocol decoded for it.
    pub substitution: Option<(Substitution, D)>,
    /// Where it ran, as its client is told (degraded mode as it is now).
    pub at: RanOn,
}

/// Run `request`, the protocol's decoding of what its client sent for `request.model`. When
/// the model's fallback may answer instead, `decode_for` decodes what the client sent again
/// for the fallback's name (the request, and what the protocol keeps to encode its answer), or
/// says why it cannot. Refused, it is counted here; run, it is counted by [`Ran::finish`].
pub async fn run<'a, D>(
    service: &'a Service,
    batching: &Batchers,
    mut request: Request,
    decode_for: impl FnOnce(&str) -> Result<(Request, D), String>,
) -> Result<Ran<'a, D>, Refused> {
    let model = request.model.clone();
    let counted = Counted::start(service, &mut request);
    let placed = match batching.place_or_fallback(request).await {
        Ok(Placement::Served(served)) => Ok((served, None)),
        Ok(Placement::Fallback(fallback)) => match decode_for(fallback.model()) {
            Ok((substitute, decoded)) => fallback
                .place(service, counted.answering(), substitute)
                .await
                .map(|(served, substitution)| (served, Some((substitution, decoded)))),
            Err(why) => Err(fallback.cannot(&why)),
        },
        Err(refused) => Err(refused),
    };
    match placed {
        Ok((served, substitution)) => Ok(Ran {
            at: service.ran_on(&served.pool, &model),
            counted,
            served,
            substitution,
        }),
        Err(refused) => {
            counted.finish(Err(&refused));
            Err(refused)
        }
    }
}

impl<D> Ran<'_, D> {
    /// Count the request with its answer as the protocol made it: served, or refused with the
    /// client's error when its answer could not be made (`made` says why; boxed: it is large,
    /// and rare).
    pub fn finish<A>(self, made: Result<A, String>) -> Result<A, Box<Refused>> {
        let Ran { counted, served, .. } = self;
        match made {
            Ok(answer) => {
                counted.finish(Ok(served.pool.as_ref()));
                Ok(answer)
            }
            Err(why) => {
                let refused = Refused::at(&served.pool, RequestError::BadInput(why));
                counted.finish(Err(&refused));
                Err(Box::new(refused))
            }
        }
    }
}
