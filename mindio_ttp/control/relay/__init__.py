"""The relay role: serving node agents below (a controller does it for its direct agents, a node
agent for the agents the controller sent to it). `children.Children` keeps which connection
serves which ranks and routes envelopes by their destination."""
