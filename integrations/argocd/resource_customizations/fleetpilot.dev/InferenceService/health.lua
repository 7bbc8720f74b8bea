-- Argo CD health of a fleetpilot InferenceService (resource.customizations.health.fleetpilot.dev_InferenceService).
--
-- Reads the conditions the operator writes, in this order:
--   no status yet, or a status older than the spec (observedGeneration) -> Progressing
--   Stalled=True      (a refused plan, a rollout past its deadline, pods refused) -> Degraded
--   Reconciling=True  (a rollout under way)                                        -> Progressing
--   Ready=True        (every role and the router rolled out and ready)             -> Healthy
--   Degraded=True     (crash loops, image pulls, unschedulable pods, ...)          -> Degraded
--   anything else                                                                 -> Progressing
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, item in ipairs(obj.status.conditions) do
    if item.type == kind then
      return item
    end
  end
  return nil
end

if obj.status == nil or obj.status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the fleetpilot operator"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to see generation " .. obj.metadata.generation
  return hs
end

local function when_true(kind, status, with_reason)
  local item = condition(kind)
  if item == nil or item.status ~= "True" then
    return nil
  end
  local message = item.message or item.reason
  if with_reason then
    message = item.reason .. ": " .. (item.message or "")
  end
  return {status = status, message = message}
end

local verdict = when_true("Stalled", "Degraded", true)
  or when_true("Reconciling", "Progressing", false)
  or when_true("Ready", "Healthy", false)
  or when_true("Degraded", "Degraded", true)
if verdict ~= nil then
  return verdict
end
local ready = condition("Ready")
hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.message or ready.reason
else
  hs.message = "Waiting for the fleetpilot operator"
end
return hs
